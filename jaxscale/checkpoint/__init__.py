"""Checkpoints: Orbax saves of the state with its data position, config and digests; restore
onto any mesh with verification and fallback; where a checkpoint given by path lives; the local
layer of copies in host memory between persistent saves (checkpoint.local).

    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    restored = checkpointer.restore(abstract_state)   # newest step that reads back as saved
"""

from jaxscale.checkpoint.local import LocalCheckpointer
from jaxscale.checkpoint.manager import CORRUPT_DIR, Checkpointer, CorruptCheckpoint, Restored
from jaxscale.checkpoint.params import load_params
from jaxscale.checkpoint.sources import CHECKPOINTS, locate

__all__ = ["CHECKPOINTS", "CORRUPT_DIR", "Checkpointer", "CorruptCheckpoint", "LocalCheckpointer", "Restored",
           "load_params", "locate"]
