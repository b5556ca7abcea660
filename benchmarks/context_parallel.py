"""Context parallelism: ring vs all-gather attention vs none, across sequence lengths.

    python benchmarks/context_parallel.py [--devices=4] [--lengths=512,1024,2048,4096] [--steps=5] [--append]

The tiny model trains one sequence per step three ways: none = on one device, which holds the
whole sequence; ring and all_gather = over `devices` devices with mesh.sequence=devices, each
holding 1/devices of it. Reports the median step time and the per-device temporary memory of
the compiled step. On a CPU the fake devices share the host's cores, so step times show the
algorithms' overheads, not the parallel speed-up real devices give.
"""

from __future__ import annotations

import argparse
import os
import sys


def _setup_devices(count: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _config(mode: str, length: int, devices: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    layout = ["mesh.data=1"] + ([] if mode == "none" else [f"mesh.sequence={devices}",
                                                           f"model.attention.context_parallel={mode}"])
    config_lib.apply_overrides(config, layout + [f"train.seq_len={length}", "train.global_batch_size=1",
                                                  "data.source=synthetic", "metrics.progress=False",
                                                  "metrics.tensorboard=False", "model.dtype=float32"])
    return config


def _measure(config, steps: int, rounds: int, devices: int) -> tuple[float, int]:
    import statistics
    import time

    import jax

    from jaxscale import loop

    run = loop.setup(config, jax.devices()[:devices])
    compiled, _ = loop.compile_step(run)
    batch = next(run.data.train_batches(0))
    state, times = run.state, []
    for _ in range(rounds * steps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    _setup_devices(args.devices)
    import datetime

    import jax

    rows = [f"### context parallelism: tiny model, {args.devices} x {jax.devices()[0].device_kind}, "
            f"one sequence per step, {datetime.date.today()}", "",
            "| seq_len | none: step, temp/device | ring: step, temp/device | all_gather: step, temp/device |",
            "|---|---|---|---|"]
    for length in (int(x) for x in args.lengths.split(",")):
        cells = []
        for mode in ("none", "ring", "all_gather"):
            step_s, temp = _measure(_config(mode, length, args.devices), args.steps, 1,
                                    1 if mode == "none" else args.devices)
            cells.append(f"{step_s * 1e3:,.0f} ms, {temp / 2**20:,.0f} MiB")
        rows.append(f"| {length} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr, flush=True)
    text = "\n".join(rows)
    print(text)
    if args.append:
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as out:
            out.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
