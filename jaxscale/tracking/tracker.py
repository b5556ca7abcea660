"""The writers a run uses, behind one object."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax

from jaxscale.errors import ConfigError, require, require_non_negative
from jaxscale.names import EXTRAS, WANDB_MODES, WRITERS


def parse_writers(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def check_writers(text: str) -> None:
    """Every writer named is known and its package installed; else a ConfigError saying what to install."""
    for name in parse_writers(text):
        if name not in WRITERS:
            raise ConfigError("tracking.writers", text, f"unknown writer '{name}'; choose from {', '.join(WRITERS)}")
        module, extra = EXTRAS.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError("tracking.writers", text, f"the {name} writer needs the '{module}' package: "
                              f"pip install '{extra}'")


def check(config) -> None:
    """The `tracking` settings are usable (a known W&B mode, writers known and installed);
    raises ConfigError naming the field."""
    mode = config.tracking.wandb_mode
    require(mode in ("", *WANDB_MODES), "tracking.wandb_mode", mode,
            "choose online, offline or disabled (or leave it empty for W&B's default)")
    check_writers(config.tracking.writers)
    require_non_negative(config, ("tracking.report_every_minutes",))


def _writer(name: str, workdir: Path, config, run_id: str | None):
    if name == "jsonl":
        from jaxscale.tracking.jsonl import JsonlWriter
        return JsonlWriter(workdir)
    if name == "tensorboard":
        from jaxscale.tracking.tensorboard import TensorBoardWriter
        return TensorBoardWriter(workdir)
    if name == "mlflow":
        from jaxscale.tracking.mlflow_run import MlflowWriter
        return MlflowWriter(workdir, config, run_id)
    from jaxscale.tracking.wandb_run import WandbWriter
    return WandbWriter(workdir, config, run_id)


class Tracker:
    """Every configured writer; a silent one on processes other than 0."""

    def __init__(self, writers: dict):
        self._writers = writers

    @classmethod
    def open(cls, workdir: Path, config, run_ids: dict | None = None) -> Tracker:
        """The writers of `tracking.writers`; MLflow/W&B continue the runs in `run_ids` if given."""
        if jax.process_index() != 0:
            return cls({})
        run_ids = run_ids or {}
        # metrics.jsonl always: the reports read it
        names = dict.fromkeys(["jsonl", *parse_writers(config.tracking.writers)])
        return cls({name: _writer(name, Path(workdir), config, run_ids.get(name)) for name in names})

    @property
    def ids(self) -> dict[str, str]:
        """{writer: run id} of the writers that have runs (MLflow, W&B), saved with each checkpoint."""
        return {name: w.run_id for name, w in self._writers.items() if getattr(w, "run_id", None)}

    def write(self, record: dict) -> None:
        for writer in self._writers.values():
            writer.write(record)

    def artifacts(self, paths: list[Path], tags: dict[str, str]) -> None:
        """Attach files (config.json, the report) and tags (the last checkpoint) to the tracker
        runs that keep them."""
        for writer in self._writers.values():
            if hasattr(writer, "artifacts"):
                writer.artifacts([p for p in paths if Path(p).exists()], tags)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
