"""TensorBoard event files in WORKDIR/tensorboard: every numeric field of a record as a scalar."""

from __future__ import annotations

from pathlib import Path

from jaxscale.tracking.fields import numeric


class TensorBoardWriter:
    def __init__(self, workdir: Path):
        from tensorboardX import SummaryWriter  # imported late: it is slow to import

        self._writer = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in numeric(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()
