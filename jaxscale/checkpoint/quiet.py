"""Silence for a save that failed and was reported.

When a write fails (a full disk), Orbax's other writer threads go on failing and log each
failure with its traceback; their asyncio tasks, never awaited again, log "Task exception was
never retrieved" when they are collected (at exit, too); and TensorStore's late completions
report errors (such as "Event loop is closed") through sys.unraisablehook from threads Python
cannot join. After the Checkpointer has turned the failure into one RunError, such reports would
land after its line, where the user looks first (and on a loaded machine, at random).
"""

from __future__ import annotations

import logging
import sys
import threading

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
        if not (_dropped or _closed_loop(unraisable.exc_value)):
            previous(unraisable)

    sys.unraisablehook = hook


def after_reported_failure() -> None:
    """From now on drop what the failed save's machinery would still report: Orbax's absl
    records, asyncio's (never-retrieved task exceptions), unraisable errors and the uncaught
    errors of threads other than the main one. Idempotent."""
    global _dropped
    closed_loops()
    if _dropped:
        return
    _dropped = True
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_DropAll())
    previous = threading.excepthook

    def hook(args):
        if args.thread is threading.main_thread():
            previous(args)

    threading.excepthook = hook
