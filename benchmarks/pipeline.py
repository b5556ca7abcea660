"""GPipe: step time against the microbatch count at a fixed number of stages, and the bubble.

    python benchmarks/pipeline.py [--stages=2] [--microbatches=2,4,8,16] [--steps=9] [--append]

Trains a 4-layer tiny model with mesh.pipeline=stages (and mesh.data=1) over a fixed global
batch, for each microbatch count M. GPipe runs M+P-1 ticks of B/M sequences each, of which P-1
are bubble, so the step time should follow  t(M) = c + c(P-1)/M. A least-squares line through
t against 1/M gives the bubble-free time c (its intercept); the table compares the measured idle
share 1 - c/t(M) with the formula (P-1)/(M+P-1).
"""

from __future__ import annotations

import argparse
import os
import sys


def _config(stages: int, count: int, batch: int, virtual: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    config_lib.apply_overrides(config, [
        "mesh.data=1", f"mesh.pipeline={stages}", f"pipeline.microbatches={count}", f"model.num_layers={4 * virtual}",
        f"pipeline.schedule={'circular' if virtual > 1 else 'gpipe'}", f"pipeline.virtual_stages={virtual}",
        f"train.global_batch_size={batch}", "train.seq_len=256", "data.source=synthetic",
        "metrics.progress=False", "metrics.tensorboard=False", "model.dtype=float32"])
    return config


def _stepper(config):
    """A function running one timed step of this config's compiled train step."""
    import time

    import jax

    from jaxscale import loop

    run = loop.setup(config)
    compiled, _ = loop.compile_step(run)
    batch, holder = next(run.data.train_batches(0)), [run.state]

    def step() -> float:
        start = time.perf_counter()
        holder[0], metrics = compiled(holder[0], batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    step()  # warm-up
    return step


def _interleaved(steppers: dict, rounds: int) -> dict:
    """Median step time per key, the keys taking turns so noise hits all alike."""
    import statistics

    times = {key: [] for key in steppers}
    for _ in range(rounds):
        for key, step in steppers.items():
            times[key].append(step())
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds; each runs one step per M")
    parser.add_argument("--virtual_stages", type=int, default=1, help="1: gpipe; >1: the circular schedule")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.stages}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import datetime

    from jaxscale.parallel.pipeline import bubble_fraction

    counts = [int(x) for x in args.microbatches.split(",")]
    batch = max(counts)
    v = args.virtual_stages
    times = _interleaved({m: _stepper(_config(args.stages, m, batch, v)) for m in counts}, args.steps)
    import numpy as np

    # GPipe/circular: t(M) = c + c(P-1)/(V M): fit t against 1/M; c is the bubble-free time.
    slope, work = np.polyfit([1 / m for m in counts], [times[m] for m in counts], 1)
    name = f"circular V={v}" if v > 1 else "gpipe"
    rows = [f"### {name}: tiny model ({4 * v} layers, seq 256), P={args.stages} on {args.stages} x cpu, "
            f"global batch {batch}, {datetime.date.today()}", "",
            "| microbatches M | median step | measured idle share | formula (P-1)/(V*M+P-1) |", "|---|---|---|---|"]
    for m in counts:
        rows.append(f"| {m} | {times[m] * 1e3:,.0f} ms | {1 - work / times[m]:.2f} | "
                    f"{bubble_fraction(args.stages, m, v):.2f} |")
    rows.append(f"\nFit: t(M) = {work * 1e3:,.0f} ms + {slope * 1e3:,.0f} ms / M, i.e. (P-1)/V = {slope / work:.2f} "
                f"(formula {(args.stages - 1) / v:.2f}).")
    text = "\n".join(rows)
    print(text)
    if args.append:
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as out:
            out.write("\n" + text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
