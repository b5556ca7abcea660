"""Silence for a save that failed and was reported.

When a write fails (a full disk), Orbax's other writer threads go on failing and log each
failure with its traceback, and TensorStore's late completions print "Event loop is closed"
tracebacks (from threads Python cannot join) once the loop that awaited them is gone. After the
Checkpointer has turned the failure into one RunError, such reports would land after its line,
where the user looks first (and on a loaded machine, at random).
"""

from __future__ import annotations

import logging
import sys

_hooked = False
_dropped = False


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _closed_loop(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def closed_loops() -> None:
    """Drop the tracebacks of callbacks that TensorStore schedules on an asyncio loop that has
    closed (an aborted write's late completion: nothing is left to tell). Idempotent."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.unraisablehook  # TensorStore reports a callback's error as unraisable

    def hook(unraisable):
        if not _closed_loop(unraisable.exc_value):
            previous(unraisable)

    sys.unraisablehook = hook


def after_reported_failure() -> None:
    """Drop Orbax's absl log records for the rest of the process: the failure they would go on
    reporting has been raised as one RunError. Idempotent."""
    global _dropped
    if not _dropped:
        _dropped = True
        logging.getLogger("absl").addFilter(_DropAll())
    closed_loops()
