"""metrics.jsonl: one JSON object per logged step, appended (a resumed run adds to it)."""

from __future__ import annotations

import json
from pathlib import Path


class JsonlWriter:
    def __init__(self, workdir: Path):
        self._file = open(Path(workdir) / "metrics.jsonl", "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
