"""Where a run starts: its workdir's own latest checkpoint, another run's checkpoint
(`checkpoint.resume_from`), parameters only (`checkpoint.init_from`), or a fresh state.

The workdir's own checkpoints always win, so restarting a preempted fine-tune continues it
rather than going back to its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jaxscale import state as state_lib
from jaxscale.checkpoint import Checkpointer, LocalCheckpointer, Restored, compat, locate
from jaxscale.errors import ConfigError, RunError
from jaxscale.runtime.runstate import RunState


@dataclasses.dataclass
class Start:
    kind: str                        # fresh | resume | init
    checkpointer: Checkpointer | None
    step: int | None = None          # a specific step, or None for the newest good one
    field: str = ""                  # the config field that named a foreign checkpoint


def choose(config, own: Checkpointer) -> Start:
    """Decide the start from the config and what the workdir holds; nothing is read yet."""
    ckpt = config.checkpoint
    if own.steps():
        if ckpt.resume_from == "none":
            raise ConfigError("checkpoint.resume_from", "none", f"{own.directory} already holds steps "
                              f"{own.steps()}; move them away or use a new --workdir to start afresh")
        return Start("resume", own)
    if ckpt.resume_from and ckpt.resume_from != "none":
        directory, step = locate(ckpt.resume_from, "checkpoint.resume_from")
        return Start("resume", Checkpointer(directory, ckpt, read_only=True), step, "checkpoint.resume_from")
    if ckpt.init_from:
        directory, step = locate(ckpt.init_from, "checkpoint.init_from")
        return Start("init", Checkpointer(directory, ckpt, read_only=True), step, "checkpoint.init_from")
    return Start("fresh", None)


def _checker(run, start: Start, say: Callable[[str], None]):
    """check(config, meta) for Checkpointer.restore: shapes must match; mesh changes are said."""
    current, learned = run.config.to_dict(), run.model.spec.arch.position == "learned"

    def check(saved: dict, meta: dict) -> None:
        where = f"checkpoint {start.checkpointer.directory}/{meta.get('step', '?')}"
        for note in compat.check(saved, current, where, params_only=start.kind == "init", learned_positions=learned):
            say(f"note: {note}")
        if "mesh" in meta and start.kind == "resume":
            now = {"mesh": dict(run.layout.mesh.shape), "zero_stage": run.layout.zero_stage,
                   "devices": run.layout.mesh.size, "processes": jax.process_count()}
            before, after = compat.describe_mesh(meta), compat.describe_mesh(now)
            if before != after:
                say(f"note: checkpoint written on mesh {before}; restoring onto {after}")
    return check


def apply(start: Start, run, say: Callable[[str], None], data: dict | None = None,
          local: LocalCheckpointer | None = None) -> tuple[RunState, dict]:
    """(the state and data position to train from, the tracker run ids saved with the
    checkpoint). The workdir's local checkpoints (`local`) come first when they are newer than
    its persistent ones. A foreign checkpointer (resume_from, init_from) is closed afterwards; a
    fresh state is made only when nothing is restored, so a run never holds two. `data` is the
    run's Data.identity(): a checkpoint written reading other data resumes with a note saying so."""
    if local is not None and not start.field:
        restored = _from_local(local, start, run, say)
        if restored is not None:
            return _resumed(restored, run, say, data, start)
    if start.kind == "fresh":
        return RunState(run.init_state()), {}
    try:
        restored = start.checkpointer.restore(_target(run, start.kind), _checker(run, start, say),
                                              params_only=start.kind == "init", step=start.step, warn=say)
    finally:
        if start.checkpointer.read_only:
            start.checkpointer.close()
    if restored is None:
        if start.field:
            raise RunError(f"{start.field}: no usable checkpoint in {start.checkpointer.directory}")
        say("no usable checkpoint left; starting from scratch")
        return RunState(run.init_state()), {}
    if start.kind == "init":
        say(f"initialised parameters from {start.checkpointer.directory}/{restored.step}; "
            "fresh optimizer state, step 0")
        return RunState(run.init_state(params=restored.state["params"])), {}
    return _resumed(restored, run, say, data, start)


def _target(run, kind: str):
    """What a checkpoint is read into: the state without its frozen base (state.changing); for
    parameters only under LoRA, the base (the adapters start afresh)."""
    abstract = run.abstract_state
    if kind == "init" and abstract.base:
        return dataclasses.replace(abstract, params=state_lib.base_target(abstract))
    return state_lib.changing(abstract)


def _from_local(local: LocalCheckpointer, start: Start, run, say) -> Restored | None:
    """The newest local checkpoint newer than the workdir's persistent ones, or None."""
    newest = start.checkpointer.latest_step() if start.kind == "resume" else None
    return local.restore(_target(run, "resume"), newest, say)


def _base(run, say) -> dict:
    """The frozen base of a LoRA run resumed from its adapters: checkpoint.init_from's parameters,
    or the seed's where the run started from no checkpoint."""
    ckpt = run.config.checkpoint
    if not ckpt.init_from:
        return run.init_state().base
    directory, step = locate(ckpt.init_from, "checkpoint.init_from")
    with Checkpointer(directory, ckpt, read_only=True) as checkpointer:
        restored = checkpointer.restore(_target(run, "init"), params_only=True, step=step, warn=say)
    if restored is None:
        raise RunError(f"checkpoint.init_from: the LoRA run's base is no longer readable in {directory}")
    say(f"frozen base read from {directory}/{restored.step}")
    return run.init_state(params=restored.state["params"]).base


def _resumed(restored: Restored, run, say, data: dict | None, start: Start) -> tuple[RunState, dict]:
    ids = {} if start.field else restored.position.get("tracking", {})  # another run's trackers stay its own
    if data is not None and restored.position.get("data", data) != data:
        say(f"note: the checkpoint was written reading {restored.position['data']}; the data now is {data}: "
            "continuing at the same global sample of the new data")
    live = _position(restored, run.config.train.global_batch_size, say)
    if run.abstract_state.base:
        live.state = dataclasses.replace(live.state, base=_base(run, say))
    return live, ids


def _position(restored, batch: int, say) -> RunState:
    """The restored state at its data position (the index of the next batch) and rollbacks."""
    sample = restored.position["global_sample"]
    live = RunState(restored.state, sample // batch, restored.position.get("rollbacks", 0))
    say(f"resuming from step {live.step} (checkpoint {restored.step}, global sample {sample:,})")
    if sample % batch:
        say(f"note: the data position (sample {sample:,}) is not a multiple of train.global_batch_size={batch}; "
            f"continuing at sample {sample // batch * batch:,}")
    return live
