"""TensorBoard event files in WORKDIR/tensorboard: every numeric field of a record as a scalar."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxscale.tracking.fields import numeric


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch when torch is not loaded yet: its
    writer module imports torch only to accept torch tensors, which cost 2.9 s of every run's
    start where torch is installed (measured); this writer passes it floats."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter:
    def __init__(self, workdir: Path):
        self._writer = _summary_writer()(str(Path(workdir) / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in numeric(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()
