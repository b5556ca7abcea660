"""Timing compiled train steps side by side: each configuration compiled once, then rounds in
which every one takes its turn, so the noise of a shared machine hits them all alike."""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple


class Stepper(NamedTuple):
    run: object       # the set-up jaxscale.loop.Run
    timed: object     # () -> seconds per step over `steps` steps
    compiled: object  # the compiled train step, for what its program runs


def stepper(config, steps: int = 1) -> Stepper:
    """The run set up, its compiled train step, and a function timing `steps` steps of it and
    returning the seconds per step. The steps take the run's own batches in order; one warm-up
    call first."""
    import jax

    from jaxscale import loop

    run = loop.setup(config)
    compiled, _ = loop.compile_step(run)
    batches = run.data.train_batches(0)

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run.state, metrics = compiled(run.state, next(batches))
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / steps

    timed()
    return Stepper(run, timed, compiled)


def interleaved(steppers: dict, rounds: int) -> dict:
    """Median of the timed calls per key over `rounds` rounds."""
    times = {key: [] for key in steppers}
    for _ in range(rounds):
        for key, timed in steppers.items():
            times[key].append(timed())
    return {key: statistics.median(t) for key, t in times.items()}
