"""Orbax checkpoints of a run: the train state and the data position, saved asynchronously.

Layout: WORKDIR/checkpoints/<step>/{state, data}. Only committed steps are restored (Orbax
writes into a temporary directory and renames it when complete; leftovers of an interrupted
save are cleaned up). The data position is the global sample index, independent of the number
of devices and processes. Restoring takes the target shardings, so a checkpoint restores onto
the mesh of the run that reads it.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxscale.state import TrainState


class Checkpointer:
    """Saves every `checkpoint.every_steps` steps and at the end; every process takes part."""

    def __init__(self, directory: Path, ckpt_cfg):
        self.every = ckpt_cfg.every_steps
        options = ocp.CheckpointManagerOptions(max_to_keep=ckpt_cfg.max_to_keep, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, shardings: TrainState, like: TrainState) -> tuple[TrainState, dict] | None:
        """(state on `shardings`, data position) of the latest committed step, or None."""
        step = self._manager.latest_step()
        if step is None:
            return None
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), like, shardings)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return restored.state, dict(restored.data)

    def save(self, step: int, state: TrainState, data_position: dict, final: bool = False) -> bool:
        """Start an async save when the step is due (or final); returns whether one started."""
        if not (final or (self.every and step % self.every == 0)) or step == self._manager.latest_step():
            return False
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)), force=True)
        return True

    def close(self) -> None:
        """Wait for the last save to commit."""
        self._manager.wait_until_finished()
        self._manager.close()
