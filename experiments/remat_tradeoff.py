"""Remat policies on one model: compiled activation memory against step time.

    python experiments/remat_tradeoff.py [--config=configs/tiny.py] [--steps=10] [--override a.b=v ...]

For each model.remat policy it compiles the train step ahead of time, reads the per-device
temporary bytes from compiled.memory_analysis(), then times `steps` steps (median) on one
resident batch. Results for the shipped configs are in experiments/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxscale import config as config_lib
from jaxscale.build import build
from jaxscale.data import make_data


def measure(config, steps: int) -> tuple[int, float]:
    run = build(config)
    batch = next(make_data(config, run.batch_sharding).train_batches(0))
    compiled, _ = run.compile()
    state, times = run.init_state(), []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return compiled.memory_analysis().temp_size_in_bytes, statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    print(f"{args.config} {' '.join(args.override)} on {jax.device_count()} x {jax.devices()[0].device_kind}")
    print("| model.remat | temp memory per device | median step time |\n|---|---|---|")
    for policy in ("none", "dots_saveable", "full"):
        config = config_lib.load(args.config)
        config_lib.apply_overrides(config, args.override + [f"model.remat={policy}", "metrics.progress=False"])
        temp, step_s = measure(config, args.steps)
        print(f"| {policy} | {temp / 2**20:,.1f} MiB | {step_s * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
