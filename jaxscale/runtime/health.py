"""A run's health: a step watchdog that ends a stuck process, and a straggler report.

Watchdog: when no step completes for `distributed.watchdog_seconds` (a peer died or hung in a
collective, a filesystem stalled), every thread's Python stack is written to stderr and the
process exits 1, so a job fails instead of hanging until its time limit. A dead peer is also
caught by the distributed runtime's heartbeat (`distributed.heartbeat_timeout_s`).

Stragglers: in a synchronous job every process waits for the slowest inside the collectives, so
raw step times are the same everywhere and cannot name it. Every `distributed.straggler_every`
steps the processes exchange instead (1) their host time per step spent getting the batch onto
their devices, and (2) the time of a short local probe (a fixed matmul on each local device, no
collectives, once the queued steps have finished); process 0 names any process whose host time
or probe is slower than the median by more than `distributed.straggler_threshold`.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.errors import require_non_negative


def check(config) -> None:
    """The watchdog and straggler settings (in `distributed`) are usable; raises ConfigError naming the field."""
    require_non_negative(config, ("distributed.watchdog_seconds", "distributed.straggler_every",
                                  "distributed.straggler_threshold"))


class Watchdog:
    """Ends a process whose steps stopped: once steps flow, no beat for `seconds` (0: off) dumps
    every thread's stack to stderr and exits 1.

    The loop calls start() before its steps, beat(step) after issuing each one, and stop() before
    waits that have their own bounds (start() again after them). The deadline arms at the second
    beat after start(): the first step waits for every process to arrive (compiling, starting,
    restoring), which on a loaded machine can outlast any step; and a beat comes when a step is
    issued, not when it has run (dispatch is asynchronous), so only the next beat shows that the
    loop got past the first step's results (it fetches step 1's metrics before issuing step 2).
    A job that hangs before its first step is left to the runtime's heartbeat and the scheduler.
    """

    ARM_AT_BEAT = 2

    def __init__(self, seconds: float, poll: float = 1.0):
        self.seconds, self._poll = seconds, min(poll, seconds / 4 or poll)
        self._beats, self._step = 0, 0
        self._since: float | None = None  # when the deadline last restarted; None while unarmed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.seconds > 0 and self._thread is None:
            self._beats, self._since, self._stop = 0, None, threading.Event()
            self._thread = threading.Thread(target=self._watch, name="jaxscale-watchdog", daemon=True)
            self._thread.start()
        return self

    @property
    def armed(self) -> bool:
        """Whether the deadline runs: from the second beat after start() until stop()."""
        return self._since is not None

    def beat(self, step: int) -> None:
        self._step, self._beats = step, self._beats + 1
        if self._beats >= self.ARM_AT_BEAT:
            self._since = time.monotonic()  # one assignment: the watching thread reads it unlocked

    def stop(self) -> None:
        self._stop.set()
        self._since = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            since = self._since
            if since is not None and time.monotonic() - since > self.seconds:
                self._expire(time.monotonic() - since)

    def _expire(self, idle: float) -> None:
        print(f"jaxscale: error: process {jax.process_index()}: no step completed for {idle:.0f}s after step "
              f"{self._step} (distributed.watchdog_seconds={self.seconds:g}); every thread's stack follows",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)


MIN_HOST_GAP_MS = 5.0  # host time slower by less than this is noise, not worth a report


@functools.partial(jax.jit, static_argnums=1)
def _probe_kernel(x, iterations: int):
    return jax.lax.fori_loop(0, iterations, lambda _, y: jnp.tanh(y @ x), x).sum()


def _probe_shape() -> tuple[int, int]:
    """(matrix size, iterations): tens of milliseconds on CPU cores (long enough that a pause of the
    process by the OS shows up in it rather than falling between probes), a few on an accelerator."""
    return (512, 4) if jax.default_backend() == "cpu" else (4096, 10)


def probe_seconds(repeats: int = 3) -> float:
    """Median time of a fixed chain of matmuls run on every local device at once (no communication)."""
    size, iterations = _probe_shape()
    inputs = [jax.device_put(jnp.full((size, size), 1.0 / size, jnp.float32), d) for d in jax.local_devices()]
    jax.block_until_ready([_probe_kernel(x, iterations) for x in inputs])  # compiled and warm
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready([_probe_kernel(x, iterations) for x in inputs])
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def stragglers(times: list[float], threshold: float, min_gap: float = 0.0) -> list[tuple[int, float]]:
    """(process, its time / the others' median) for each process slower than the median of the
    others by more than `threshold` (a fraction) and by at least `min_gap`."""
    found = []
    for i, t in enumerate(times):
        others = statistics.median(times[:i] + times[i + 1:]) if len(times) > 1 else t
        if others > 0 and t > others * (1 + threshold) and t - others >= min_gap:
            found.append((i, t / others))
    return found


class StragglerReport:
    """Accumulates this process's host time per step; every `every` steps all processes share it
    and their probe times."""

    def __init__(self, every: int, threshold: float, say: Callable[[str], None]):
        self.every, self.threshold, self._say = every, threshold, say
        self._busy, self._count = 0.0, 0
        self.last: dict[str, list[float]] | None = None  # the last exchange: per-process ms, by measure

    def add(self, step: int, host_seconds: float, state=None) -> None:
        """Record a step; every `every` steps a collective, so every process must call it each step.
        `state` (the step's output) is waited for before probing, so queued steps do not count."""
        if self.every <= 0 or jax.process_count() == 1:
            return
        self._busy, self._count = self._busy + host_seconds, self._count + 1
        if step % self.every == 0:
            jax.block_until_ready(state)
            self._exchange(step, [self._busy / self._count, probe_seconds()])

    def _exchange(self, step: int, mine: list[float]) -> None:
        from jax.experimental import multihost_utils

        gathered = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.float32))) * 1e3
        self.last = {"host_ms_per_step": gathered[:, 0].tolist(), "probe_ms": gathered[:, 1].tolist()}
        self._busy, self._count = 0.0, 0
        for measure, label, gap in (("host_ms_per_step", "host time per step (batch onto the devices)",
                                     MIN_HOST_GAP_MS), ("probe_ms", "local device probe", 0.0)):
            times = self.last[measure]
            for process, ratio in stragglers(times, self.threshold, gap):
                self._say(f"straggler: process {process}'s {label} is {times[process]:.1f} ms, "
                          f"{100 * (ratio - 1):.0f}% above the other processes' median (steps to {step})")
