"""Profiler capture of a window of training steps: profile.start_step, profile.steps.

The trace goes to WORKDIR/profile (one per process): open it with TensorBoard's profile
plugin or XProf (`xprof --logdir WORKDIR/profile`), or load the .trace.json.gz in Perfetto.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax

from jaxscale.errors import require_non_negative


def check(config) -> None:
    """The `profile` window is usable; raises ConfigError naming the field."""
    require_non_negative(config, ("profile.start_step", "profile.steps"))


class TraceWindow:
    """Starts jax.profiler before step `start` and stops it after `steps` steps (0 = off)."""

    def __init__(self, start: int, steps: int, directory: Path, say: Callable[[str], None]):
        self.first, self.last = start, start + steps - 1
        self.directory, self._say, self.active = Path(directory), say, False
        self.enabled = steps > 0

    def before(self, step: int) -> None:
        if self.enabled and step == self.first and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and step >= self.last:
            self.stop(state, step)

    def stop(self, state=None, step: int | None = None) -> None:
        """End the trace (waiting for the traced steps to finish on the devices)."""
        if not self.active:
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        self._say(f"profile of steps {self.first}..{step if step is not None else '?'} written to {self.directory} "
                  "(TensorBoard's profile plugin or xprof; the .trace.json.gz opens in Perfetto)")
