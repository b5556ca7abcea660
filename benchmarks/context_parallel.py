"""Context parallelism: ring vs all-gather attention vs none, across sequence lengths.

    python benchmarks/context_parallel.py [--devices=4] [--lengths=512,1024,2048,4096] [--steps=5]
        [--json] [--append] [--smoke]

The tiny model trains one sequence per step three ways: none = on one device, which holds the
whole sequence; ring and all_gather = over `devices` devices with mesh.sequence=devices, each
holding 1/devices of it. Reports the median step time and the per-device temporary memory of
the compiled step. On a CPU the fake devices share the host's cores, so step times show the
algorithms' overheads, not the parallel speed-up real devices give. `--json` prints one row
per (seq_len, mode) with step_s and temp_bytes.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import sys

import _steps

MODES = ("none", "ring", "all_gather")


def _config(mode: str, length: int, devices: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    layout = ["mesh.data=1"] + ([] if mode == "none" else [f"mesh.sequence={devices}",
                                                           f"model.attention.context_parallel={mode}"])
    config_lib.apply_overrides(config, layout + [f"train.seq_len={length}", "train.global_batch_size=1",
                                                  "data.source=synthetic", "metrics.progress=False",
                                                  "tracking.writers=jsonl", "model.dtype=float32"])
    return config


def _measure(config, steps: int, rounds: int, devices: int) -> tuple[float, int]:
    import statistics
    import time

    import jax

    _, compiled, _, state, batches = _steps.prepare(config, jax.devices()[:devices])
    batch, times = next(batches), []
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
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        args.devices, args.lengths, args.steps = 2, "64", 1
    _common.fake_cpu_devices(args.devices)
    import jax

    rows, lines = [], ["| seq_len | none: step, temp/device | ring: step, temp/device "
                       "| all_gather: step, temp/device |", "|---|---|---|---|"]
    for length in (int(x) for x in args.lengths.split(",")):
        for mode in MODES:
            step_s, temp = _measure(_config(mode, length, args.devices), args.steps, 1,
                                    1 if mode == "none" else args.devices)
            rows.append({"seq_len": length, "mode": mode, "step_s": step_s, "temp_bytes": temp})
        lines.append(f"| {length} | " + " | ".join(f"{r['step_s'] * 1e3:,.0f} ms, {r['temp_bytes'] / 2**20:,.0f} MiB"
                                                   for r in rows[-len(MODES):]) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    title = f"context parallelism: tiny model, {args.devices} x {jax.devices()[0].device_kind}, one sequence per step"
    _common.report(args, _common.entry(title, "\n".join(lines)),
                   {"benchmark": "context_parallel", "devices": args.devices, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
