"""Orbax checkpoints of a run: the train state, the data position, the config and metadata.

Layout: CHECKPOINTS/<step>/{state, data, meta, config}. `data` is the global sample index the
next batch starts at, independent of the number of devices and processes; `meta` holds the
tokens seen, the mesh, versions and a digest per array (checkpoint.digest); `config` is the
run's whole config. Saves are asynchronous and every process takes part. Orbax writes into a
temporary directory and renames it when complete, so only committed steps are ever restored;
leftovers of an interrupted save are removed when the next run opens the directory. A step
that fails to read or to match its digests is moved aside and the previous one is used.
Restoring takes the target shardings, so a checkpoint restores onto any mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import shutil
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxscale.checkpoint import digest, quiet
from jaxscale.errors import RunError

CORRUPT_DIR = "checkpoints.corrupt"  # beside the checkpoints directory: steps that failed their check
JSON_ITEMS = ("data", "meta", "config")  # beside `state` in every step
WRITER_GRACE_S = 30.0  # after a failed save, how long the other writers may take to stop


class CorruptCheckpoint(Exception):
    """A step that cannot be read back as saved."""


@dataclasses.dataclass
class Restored:
    step: int
    state: object       # the target's structure (a TrainState, or {'params': ...} when params_only)
    position: dict      # {'global_sample': int, ...}
    meta: dict
    config: dict


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def _root_cause(error: BaseException) -> str:
    """The innermost cause's first line: Orbax wraps TensorStore's useful message."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return str(error).splitlines()[0][:600] if str(error) else type(error).__name__


def _all_processes(ok: bool) -> bool:
    """True only if every process says so, so they all take the same branch."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _options(ckpt_cfg, read_only: bool) -> ocp.CheckpointManagerOptions:
    if read_only:  # every saving option off already, so Orbax has none to turn off (and warn about)
        return ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    keep = [ocp.checkpoint_managers.LatestN(n=ckpt_cfg.max_to_keep)]
    if ckpt_cfg.keep_every:
        keep.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=ckpt_cfg.keep_every))
    return ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep),
        cleanup_tmp_directories=True, enable_async_checkpointing=True)


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler, splitting the writing of a replicated array across its replicas only
    when they live on several hosts. On one host the split buys nothing, yet costs a compiled
    slicing program per array shape and replica (65 compiles, 5 seconds, before the first save of
    a data=8 state here)."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (jax.Array, th.ArrayHandler(use_replica_parallel=jax.process_count() > 1)),
        (np.ndarray, th.NumpyHandler()), (int, th.ScalarHandler()), (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _without_absl_warning(prefix: str):
    """Drop Orbax's absl log records that start with `prefix` while the block runs (only those:
    any other warning, from any thread, still shows)."""
    logger, drop = logging.getLogger("absl"), _Drop(prefix)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class Checkpointer:
    """Saves when due (every N steps, every M minutes) and restores the newest good step.

    read_only=True opens another run's checkpoints: nothing there is written, moved or deleted.
    """

    def __init__(self, directory: Path, ckpt_cfg, read_only: bool = False):
        self.directory, self.read_only = Path(directory).absolute(), read_only
        self._every = 0 if read_only else ckpt_cfg.every_steps
        minutes = 0 if read_only else ckpt_cfg.every_minutes
        self._timer = ocp.checkpoint_managers.ContinuousCheckpointingPolicy(
            minimum_interval_secs=minutes * 60) if minutes else None
        self._last_save_time: datetime.datetime | None = None  # the clock starts at the first due()
        self._pending: int | None = None  # step of the save in flight
        self._failed = False              # a failed save was reported; do not report it twice
        self._digester = digest.Digester()
        quiet.closed_loops()
        handlers = {"state": _state_handler(), **{item: ocp.JsonCheckpointHandler() for item in JSON_ITEMS}}
        # A read-only manager warns that its directory is read only: what was asked for, not news.
        with _without_absl_warning("Given directory is read only"):
            self._manager = ocp.CheckpointManager(self.directory, options=_options(ckpt_cfg, read_only),
                                                  item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether the interval or the time policy asks for a save at this step. With
        checkpoint.every_minutes, process 0 decides and tells the others, so every process
        must call this at every step."""
        self._digester.poll()
        if self._every and step % self._every == 0:
            return True
        if self._timer is None:
            return False
        if self._last_save_time is None:
            self._last_save_time = _now()
            return False
        context = ocp.checkpoint_managers.DecisionContext(
            is_saving_in_progress=self._manager.is_saving_in_progress(), reached_preemption=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions())
        previous = types.SimpleNamespace(step=self.latest_step(), time=self._last_save_time, metrics=None)
        current = types.SimpleNamespace(step=step, time=_now(), metrics=None)
        return self._timer.should_save(current, [previous], context=context)

    def save(self, step: int, state, position: dict, meta: dict, config: dict) -> None:
        """Start an asynchronous save of `state`: blocks only while the arrays are copied off the
        devices (the digests are computed meanwhile and written by the background commit; the
        first save of a run compiles their program in the background, see digest.Digester).
        Raises RunError if the previous save failed."""
        self._digester.finish()  # Orbax waits for the previous commit, which waits for its digests
        if step == self.latest_step():
            return
        digests = digest.pending(state)
        meta = dict(meta, step=step, saved_at=_now().isoformat(), digests=digests)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(position),
                                  meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(config))
        try:
            self._surface_errors(lambda: self._manager.save(step, args=args, force=True))
            self._digester.start(state, digests)  # before the next step can donate the state
        except BaseException as error:
            digests.provide(error=error)  # never leave the commit thread waiting
            raise
        self._pending, self._last_save_time = step, _now()

    def check(self) -> None:
        """Raise RunError if a save running in the background has failed."""
        self._digester.poll()
        self._surface_errors(self._manager.check_for_errors)

    def wait(self) -> None:
        """Block until the save in flight has committed (or raise RunError)."""
        self._digester.finish()
        self._surface_errors(self._manager.wait_until_finished)
        self._pending = None

    def _surface_errors(self, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as error:  # Orbax re-raises whatever its writer thread hit
            if self._failed:
                return
            self._failed = True
            step, self._pending = self._pending, None
            self._digester.finish()  # no writer is left waiting for the digests
            _let_writers_finish(WRITER_GRACE_S)  # their errors are logged before ours, not after it
            self._remove_unfinished(step)
            quiet.after_reported_failure()
            latest = self.latest_step()
            kept = f"step {latest} is the latest intact checkpoint" if latest is not None else "no checkpoint is intact"
            raise RunError(f"checkpoint step {step} could not be written to {self.directory}: "
                           f"{_root_cause(error)}; {kept}. Fix the cause (e.g. free disk space) and run the "
                           "same command again to resume") from error

    def _remove_unfinished(self, step: int | None) -> None:
        if step is not None and jax.process_index() == 0:
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)

    def read_json(self, step: int) -> tuple[dict, dict, dict]:
        """(data position, meta, config) of a step; CorruptCheckpoint if they do not read."""
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(
                data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
        except Exception as error:
            raise CorruptCheckpoint(f"its metadata does not read ({_root_cause(error)})") from error
        return dict(got.data), dict(got.meta), dict(got.config)

    def _read_state(self, step: int, target, params_only: bool):
        item = {"params": target.params} if params_only else target
        restore = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                         partial_restore=params_only)
        try:
            state, ok = self._manager.restore(step, args=ocp.args.Composite(state=restore)).state, True
        except Exception as error:
            state, ok, cause = None, False, _root_cause(error)
        if not _all_processes(ok):
            raise CorruptCheckpoint(f"an array does not read ({cause if not ok else 'on another process'})")
        return state

    def restore_step(self, step: int, target, check: Callable[[dict, dict], None] = lambda config, meta: None,
                     params_only: bool = False) -> Restored:
        """Read one step into `target` (sharded ShapeDtypeStructs) and verify its digests.
        `check(config, meta)` runs before any array is read and may raise ConfigError."""
        position, meta, config = self.read_json(step)
        check(config, meta)
        state = self._read_state(step, target, params_only)
        saved = meta.get("digests", {})
        if params_only:
            saved = {path: value for path, value in saved.items() if path.startswith("params/")}
        bad = digest.mismatches(saved, digest.digests(state))
        if bad:
            raise CorruptCheckpoint(f"{len(bad)} arrays differ from their saved digests ({', '.join(bad[:3])})")
        return Restored(step, state, position, meta, config)

    def restore(self, target, check=lambda config, meta: None, params_only: bool = False,
                step: int | None = None, warn: Callable[[str], None] = print,
                before: int | None = None) -> Restored | None:
        """The newest committed step (or exactly `step`; or the newest before `before`) that
        reads back as saved; a step that does not is reported through `warn`, moved to
        checkpoints.corrupt/ (unless read-only) and the previous one is tried. None if no step
        is left. A requested `step` that fails raises RunError instead."""
        candidates = [step] if step is not None else [s for s in self.steps() if before is None or s < before]
        for candidate in reversed(candidates):
            try:
                return self.restore_step(candidate, target, check, params_only)
            except CorruptCheckpoint as problem:
                if step is not None:
                    raise RunError(f"checkpoint {self.directory / str(step)} is unusable: {problem}") from None
                warn(f"warning: checkpoint step {candidate} in {self.directory} is unusable: {problem}; "
                     f"{self._set_aside(candidate)}trying the previous one")
        return None

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints newer than `step` (after a rollback to it)."""
        for newer in [s for s in self.steps() if s > step]:
            self._manager.delete(newer)

    def _set_aside(self, step: int) -> str:
        """Move a bad step out of the manager's directory (kept for inspection, never deleted)."""
        if self.read_only:
            return ""
        destination = self.directory.parent / CORRUPT_DIR / f"{step}-{_now():%Y%m%dT%H%M%S}"
        if jax.process_index() == 0:
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.directory / str(step), destination)
        multihost_utils.sync_global_devices(f"jaxscale_set_aside_{step}")
        self._manager.reload()
        return f"moved it to {destination}; "

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save to commit, then release Orbax's threads; raises RunError if
        that save failed."""
        try:
            self.wait()
        finally:
            self._manager.close()


def _let_writers_finish(grace_s: float) -> None:
    """Wait up to grace_s for Orbax's background writer threads: after one of them fails, the
    others may still be writing (and will log their own failures) into the step being removed."""
    deadline = time.monotonic() + grace_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax."):
            thread.join(max(0.0, deadline - time.monotonic()))
