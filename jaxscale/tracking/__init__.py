"""Where a run's metrics go, chosen by `tracking.writers`: any of jsonl, tensorboard, mlflow, wandb.

    tracker = Tracker.open(workdir, config, run_ids)   # process 0 writes; the others get a silent one
    tracker.write(record); tracker.artifacts([...]); tracker.close()

MLflow and W&B runs are resumed, not restarted, when a run resumes: their ids are saved with each
checkpoint (`tracker.ids`) and handed back here.
"""

from jaxscale.tracking.fields import flat_config
from jaxscale.tracking.tracker import EXTRAS, WRITERS, Tracker, check, check_writers, parse_writers

__all__ = ["EXTRAS", "WRITERS", "Tracker", "check", "check_writers", "flat_config", "parse_writers"]
