"""A Weights & Biases run: the flattened config, a metric history, files. Honours W&B's own
settings (WANDB_MODE, WANDB_API_KEY, ...) unless tracking.wandb_mode says otherwise; in offline
mode the run is written under WORKDIR/wandb for `wandb sync`."""

from __future__ import annotations

from pathlib import Path

from jaxscale.tracking.fields import flat_config, numeric


class WandbWriter:
    def __init__(self, workdir: Path, config, run_id: str | None):
        import wandb

        t, workdir = config.tracking, Path(workdir)
        self._run = wandb.init(project=t.experiment, name=t.run_name or workdir.name, dir=str(workdir),
                               id=run_id, resume="allow" if run_id else None, config=flat_config(config),
                               mode=t.wandb_mode or None, reinit="create_new")
        self.run_id = self._run.id

    def write(self, record: dict) -> None:
        self._run.log(numeric(record), step=record["step"])

    def artifacts(self, paths: list[Path], tags: dict[str, str]) -> None:
        for path in paths:
            self._run.save(str(path), base_path=str(Path(path).parent), policy="now")
        self._run.summary.update({f"jaxscale.{k}": v for k, v in tags.items()})

    def close(self) -> None:
        self._run.finish()
