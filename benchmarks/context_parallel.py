"""Context parallelism: ring vs all-gather vs Ulysses attention vs none, across sequence lengths.

    python benchmarks/context_parallel.py [--devices=4] [--lengths=512,1024,2048,4096] [--steps=5]
        [--compile_only] [--budget_mib=N [--max_length=L]] [--json] [--append] [--smoke]

The tiny model trains one sequence per step four ways: none = on one device, which holds the
whole sequence; ring, all_gather and ulysses = over `devices` devices with mesh.sequence=devices,
each holding 1/devices of it (ulysses needs the model's 4 heads to divide by `devices`).
Reports the median step time and the per-device temporary memory of the compiled step. On a
CPU the fake devices share the host's cores, so step times show the algorithms' overheads, not
the parallel speed-up real devices give. `--compile_only` reports temporaries alone (no steps:
long sequences compile in seconds). `--budget_mib`: for none and ring, the longest power-of-two
sequence (from 1024, up to --max_length) whose compiled step's per-device temporaries fit in
that many MiB. `--json` prints one row per (seq_len, mode) with
step_s (None with --compile_only) and temp_bytes, and `longest` per mode with --budget_mib.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import sys

import _steps

MODES = ("none", "ring", "all_gather", "ulysses")


def _config(mode: str, length: int, devices: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    layout = ["mesh.data=1"] + ([] if mode == "none" else [f"mesh.sequence={devices}",
                                                           f"model.attention.context_parallel={mode}"])
    config_lib.apply_overrides(config, layout + [f"train.seq_len={length}", "train.global_batch_size=1",
                                                  "data.source=synthetic", "metrics.progress=False",
                                                  "tracking.writers=jsonl", "model.dtype=float32"])
    return config


def _temp(config, devices: int) -> int:
    """Per-device temporaries of the compiled step, allocating nothing."""
    import jax

    from jaxscale.plan import compile_plan

    return compile_plan(config, jax.default_backend(), jax.devices()[:devices])[1].memory_analysis().temp_size_in_bytes


def _longest(mode: str, budget: int, max_length: int, devices: int) -> int | None:
    """The longest power-of-two seq_len (1024 ... max_length) whose step fits `budget` bytes a device."""
    fits, length = None, 1024
    while length <= max_length and _temp(_config(mode, length, devices), 1 if mode == "none" else devices) <= budget:
        fits, length = length, 2 * length
    return fits


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
    parser.add_argument("--compile_only", action="store_true", help="temporaries only, no steps")
    parser.add_argument("--budget_mib", type=float, default=0.0, help="find the longest sequence fitting this")
    parser.add_argument("--max_length", type=int, default=1 << 20)
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        args.devices, args.lengths, args.steps, args.budget_mib, args.max_length = 2, "64", 1, 1e6, 1024
    _common.fake_cpu_devices(args.devices)
    import jax

    rows, lines = [], ["| seq_len | " + " | ".join(f"{mode}: step, temp/device" for mode in MODES) + " |",
                       "|---|" + "---|" * len(MODES)]
    for length in (int(x) for x in args.lengths.split(",")):
        for mode in MODES:
            config, devices = _config(mode, length, args.devices), 1 if mode == "none" else args.devices
            step_s, temp = (None, _temp(config, devices)) if args.compile_only else _measure(config, args.steps, 1,
                                                                                                devices)
            rows.append({"seq_len": length, "mode": mode, "step_s": step_s, "temp_bytes": temp})
        lines.append(f"| {length} | " + " | ".join(_cell(r) for r in rows[-len(MODES):]) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    longest = {}
    if args.budget_mib:
        longest = {mode: _longest(mode, int(args.budget_mib * 2**20), args.max_length, args.devices)
                   for mode in ("none", "ring")}
        lines.append(f"\nLongest power-of-two sequence within {args.budget_mib:,.0f} MiB of temporaries per device: "
                     + ", ".join(f"{mode} {length}" for mode, length in longest.items()))
    title = f"context parallelism: tiny model, {args.devices} x {jax.devices()[0].device_kind}, one sequence per step"
    _common.report(args, _common.entry(title, "\n".join(lines)),
                   {"benchmark": "context_parallel", "devices": args.devices, "steps": args.steps, "rows": rows,
                    "longest": longest})


def _cell(row: dict) -> str:
    temp = f"{row['temp_bytes'] / 2**20:,.0f} MiB"
    return temp if row["step_s"] is None else f"{row['step_s'] * 1e3:,.0f} ms, {temp}"


if __name__ == "__main__":
    main()
