"""An MLflow run: parameters (the flattened config), a metric history per field, artifacts.

The default store is MLflow's local SQLite store in WORKDIR/mlflow.db (artifacts in
WORKDIR/mlartifacts): no server needed; MLflow 3 refuses the older ./mlruns file store.
`mlflow ui --backend-store-uri sqlite:///WORKDIR/mlflow.db` shows it.
"""

from __future__ import annotations

import time
from pathlib import Path

from jaxscale.tracking.fields import flat_config, numeric

PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch


def default_uri(workdir: Path) -> str:
    return f"sqlite:///{(Path(workdir) / 'mlflow.db').absolute()}"


class MlflowWriter:
    def __init__(self, workdir: Path, config, run_id: str | None):
        from mlflow.tracking import MlflowClient

        t, workdir = config.tracking, Path(workdir)
        self._client = MlflowClient(tracking_uri=t.mlflow_uri or default_uri(workdir))
        if run_id:  # a resumed run continues its tracker run
            self.run_id = run_id
            self._client.update_run(run_id, status="RUNNING")
            return
        experiment = self._client.get_experiment_by_name(t.experiment)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(
            t.experiment, artifact_location=None if t.mlflow_uri else str((workdir / "mlartifacts").absolute()))
        self.run_id = self._client.create_run(experiment_id, run_name=t.run_name or workdir.name).info.run_id
        self._params(flat_config(config))

    def _params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=items[i:i + PARAMS_PER_CALL])

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, record["step"])
                                                     for k, v in numeric(record).items()])

    def artifacts(self, paths: list[Path], tags: dict[str, str]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))
        for key, value in tags.items():
            self._client.set_tag(self.run_id, f"jaxscale.{key}", value)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
