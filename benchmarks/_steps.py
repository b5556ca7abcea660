"""Timing compiled train steps side by side: each configuration compiled once, then rounds in
which every one takes its turn, so the noise of a shared machine hits them all alike."""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple


class Stepper(NamedTuple):
    run: object       # the built jaxscale.build.Run
    timed: object     # () -> seconds per step over `steps` steps
    compiled: object  # the compiled train step, for what its program runs
    live: dict        # {'state': the latest TrainState, 'metrics': the latest step's metrics}


def prepare(config, devices=None):
    """(the built Run, its train step compiled ahead of time, compile seconds, a fresh state, the
    run's training batches from the start) on `devices` (default: all); glibc malloc set up as the
    CLI sets it (jaxscale/runtime/cpu_malloc.py)."""
    from jaxscale.build import build
    from jaxscale.data import make_data
    from jaxscale.runtime import cpu_malloc

    cpu_malloc.apply_cpu_defaults(config.xla)  # before JAX starts its CPU threads
    run = build(config, devices)
    compiled, seconds = run.compile()
    cpu_malloc.fit_scratch(compiled)
    return run, compiled, seconds, run.init_state(), make_data(config, run.batch_sharding).train_batches(0)


def stepper(config, steps: int = 1) -> Stepper:
    """The run built, its compiled train step, and a function timing `steps` steps of it and
    returning the seconds per step. The steps take the run's own batches in order; one warm-up
    call first."""
    import jax

    run, compiled, _, state, batches = prepare(config)
    live = {"state": state}

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            live["state"], live["metrics"] = compiled(live["state"], next(batches))
        jax.block_until_ready(live["metrics"])
        return (time.perf_counter() - start) / steps

    timed()
    return Stepper(run, timed, compiled, live)


def interleaved_rounds(steppers: dict, rounds: int) -> dict[str, list[float]]:
    """Each key's timed calls, one a round, over `rounds` rounds in which every key takes its turn."""
    times = {key: [] for key in steppers}
    for _ in range(rounds):
        for key, timed in steppers.items():
            times[key].append(timed())
    return times


def interleaved(steppers: dict, rounds: int) -> dict:
    """Median of the timed calls per key over `rounds` rounds."""
    return {key: statistics.median(t) for key, t in interleaved_rounds(steppers, rounds).items()}
