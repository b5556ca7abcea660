"""Experiment tracking: JSONL and TensorBoard, a real MLflow store read back with mlflow's own
client, W&B in offline mode, resumed runs continuing their tracker runs, and the run report."""

import json
import subprocess
import sys

import pytest

from conftest import LazyModule, main_cli
from jaxscale import report, tracking
from jaxscale.errors import ConfigError
from jaxscale.runtime.loop import train

mlflow = LazyModule("mlflow")


def test_jsonl_and_tensorboard(tiny_config, tmp_path):
    tiny_config.tracking.writers = "tensorboard"  # metrics.jsonl is always written too
    tracker = tracking.Tracker.open(tmp_path, tiny_config)
    tracker.write({"step": 1, "loss": 2.5, "mfu": None})
    tracker.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5, "mfu": None}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch when it can (2.9 s); the writer keeps it out, and leaves no
    trace in sys.modules that would stop a later `import torch`."""
    code = ("import sys; from jaxscale.tracking.tensorboard import TensorBoardWriter; "
            f"w = TensorBoardWriter({str(tmp_path)!r}); w.write({{'step': 1, 'loss': 2.0}}); w.close(); "
            "assert 'torch' not in sys.modules and 'tensorboardX' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_and_uninstalled_writers_are_one_line_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"tracking.writers='jsonl,comet': unknown writer 'comet'"):
        tracking.check_writers("jsonl,comet")
    monkeypatch.setitem(tracking.tracker.EXTRAS, "mlflow", ("jaxscale_no_such_module", "jaxscale[mlflow]"))
    with pytest.raises(ConfigError, match=r"pip install 'jaxscale\[mlflow\]'"):
        tracking.check_writers("jsonl,mlflow")


def test_mlflow_store_reads_back_and_a_resumed_run_continues_it(tiny_config, tmp_path):
    args = ["--config=configs/tiny.py", "--config.tracking.writers=jsonl,mlflow", "--config.tracking.report=True",
            f"--workdir={tmp_path}", "--config.train.steps=6", "--config.train.log_every=2",
            "--config.train.eval_every=0"]
    done = main_cli(args)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = main_cli([*args[:-3], "--config.train.steps=10", "--config.train.log_every=2",
                        "--config.train.eval_every=0"])
    assert resumed.returncode == 0 and "resuming from step 6" in resumed.stdout, resumed.stderr[-2000:]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["jaxscale"])
    assert len(runs) == 1  # the resumed session continued the same run
    run = runs.iloc[0]
    assert run["params.model.d_model"] == "128" and run["params.train.global_batch_size"] == "16"
    client = mlflow.tracking.MlflowClient()
    assert [m.step for m in client.get_metric_history(run.run_id, "loss")] == [1, 2, 4, 6, 8, 10]
    logged = {a.path for a in client.list_artifacts(run.run_id)}
    assert {"config.json", "report.md", "loss.png"} <= logged
    assert client.get_run(run.run_id).data.tags["jaxscale.last_checkpoint"].endswith("checkpoints/10")


def test_wandb_offline_resumes_its_run(tiny_config, tmp_path):
    pytest.importorskip("wandb")
    tiny_config.tracking.update(writers="jsonl,wandb", wandb_mode="offline")
    tiny_config.train.update(steps=6, eval_every=0)
    train(tiny_config, tmp_path, show_progress=False, until=3)
    train(tiny_config, tmp_path, show_progress=False)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one run id, resumed
    assert all(list(r.glob("run-*.wandb")) for r in runs)


def _is_png(path) -> bool:
    import matplotlib.image

    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(path).shape[0] > 100


def test_run_report_and_comparison(tiny_config, tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(report, "write", lambda workdir, write=report.write: written.append(workdir) or write(workdir))
    tiny_config.tracking.update(report=True, report_every_minutes=0)
    tiny_config.train.update(steps=6, log_every=2, eval_every=3)
    train(tiny_config, tmp_path / "a", show_progress=False)
    assert written == [tmp_path / "a"] * 2  # at the evaluation of step 3, and at the end
    for name in report.PLOTS:
        assert _is_png(tmp_path / "a" / name), name
    text = (tmp_path / "a" / "report.md").read_text()
    assert "step 6: loss" in text and "val_loss" in text and "params/embed" in text and "goodput" in text
    tiny_config.optim.lr = 1e-3
    tiny_config.tracking.report_every_minutes = 10  # the default: a run this short draws it once, at the end
    train(tiny_config, tmp_path / "b", show_progress=False)
    assert written[2:] == [tmp_path / "b"]
    monkeypatch.undo()  # the command below calls report.write itself
    done = main_cli(["--workdir=" + str(tmp_path / "a"), "--compare", str(tmp_path / "b")], module="jaxscale.report")
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("| a | 6 |" in (tmp_path / "a" / "report.md").read_text()
            and "| b | 6 |" in (tmp_path / "a" / "report.md").read_text())
    bad = main_cli(["--workdir=" + str(tmp_path / "nothing")], module="jaxscale.report")
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr
