"""Stop cleanly on SIGTERM or SIGINT: finish the step in flight, checkpoint it, exit 0.

One process: a Python handler notes the signal and the loop stops after the current step.
Several processes: JAX's distributed runtime catches SIGTERM (its preemption sync manager),
tells every process, and `reached(step)` turns true on all of them at the same step, so they
all save the same step. SIGINT is re-sent to this process as SIGTERM to take the same path.
A second signal stops at once (Python's default behaviour), leaving the committed checkpoints.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _jax_service() -> bool:
    """Whether JAX's preemption sync manager coordinates the processes."""
    return jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)


class PreemptionWatch:
    """Context manager that installs the handlers; call `reached(step)` once per step on every
    process. Outside the main thread (where Python cannot take signals) it never fires."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> PreemptionWatch:
        self.signal_name, self.received_at = None, None
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            if sig == signal.SIGTERM and _jax_service():
                continue  # JAX's runtime owns SIGTERM and shares it with every process
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        for sig, handler in self._previous.items():  # a second signal acts as if we were not here
            signal.signal(sig, handler)
        self.signal_name, self.received_at = signal.Signals(signum).name, time.monotonic()
        if signum == signal.SIGINT and _jax_service():
            os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """Whether to stop after `step` (the same answer on every process)."""
        if _jax_service():
            hit = multihost_utils.reached_preemption_sync_point(step)
            if hit and self.received_at is None:
                self.signal_name, self.received_at = "SIGTERM", time.monotonic()
            return hit
        return self.received_at is not None

    def elapsed(self) -> float:
        """Seconds since the signal was seen here."""
        return time.monotonic() - self.received_at

    def start_deadline(self, expire: Callable[[], None]) -> None:
        """Call `expire` (which should end the process) if the stop takes longer than timeout_s."""
        self._deadline = threading.Timer(max(self.timeout_s - self.elapsed(), 0.0), expire)
        self._deadline.daemon = True
        self._deadline.start()

    def __exit__(self, *exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
