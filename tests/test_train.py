"""End to end: the CLI and the loop train on real text and write their metrics."""

import json
import re

import numpy as np
import pytest

from conftest import fast_run_steps, main_cli, run_cli
from jaxscale.runtime.loop import train

FIELDS = ("step", "loss", "tokens_per_sec", "step_time_s", "mfu", "grad_norm", "lr", "tokens")


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The acceptance command: tiny config, 50 steps, 8 fake devices, through the CLI's main in
    this process (10 s against 14 s in a process of its own, measured)."""
    workdir = tmp_path_factory.mktemp("cli8")
    with fast_run_steps():  # in this process: its 8 devices, the steps at FAST_RUN's level
        result = main_cli(["--config=configs/tiny.py", "--config.train.steps=50", f"--workdir={workdir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def test_cli_writes_metrics_and_loss_falls(cli_run):
    workdir, result = cli_run
    records = _records(workdir)
    assert all(field in r for r in records for field in FIELDS)
    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 50
    assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
    assert first["mfu"] is None  # CPU: no known peak
    assert last["tokens"] == 50 * 16 * 128
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 50
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert "step 50" in result.stdout


@pytest.fixture(scope="module")
def one_device_loss(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli1")
    result = run_cli(["--config=configs/tiny.py", "--config.train.steps=1", f"--workdir={workdir}"], devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return _records(workdir)[0]["loss"]


def test_one_device_gives_same_first_loss(cli_run, one_device_loss):
    workdir, _ = cli_run
    np.testing.assert_allclose(_records(workdir)[0]["loss"], one_device_loss, rtol=1e-5)


def test_mixed_layout_gives_same_first_loss(one_device_loss, tmp_path):
    """data x fsdp x tensor with ZeRO-1, from the command line: one device's first loss. (Layouts
    that split the sequence: test_step's layout and context-parallel cases, test_masks, and
    test_checkpoint's restore onto data2_sequence2_tensor2_zero3, which trains through the loop.)"""
    layout = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.zero_stage=1"]
    result = main_cli(["--config=configs/tiny.py", "--config.train.steps=1", f"--workdir={tmp_path}", *layout])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh data=2 fsdp=2 tensor=2 zero_stage=1" in result.stdout
    np.testing.assert_allclose(_records(tmp_path)[0]["loss"], one_device_loss, rtol=1e-5)


def _text_file(path, size=1_000_000):
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    path.write_text((text * (size // len(text) + 1))[:size])
    return path


def test_text_file_trains_and_logs_val_loss(tiny_config, tmp_path):
    tiny_config.data.path = str(_text_file(tmp_path / "corpus.txt"))
    tiny_config.train.update(steps=10, eval_every=5)
    records = train(tiny_config, tmp_path / "run", show_progress=False)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert all(np.isfinite(r["val_loss"]) for r in evals)
    assert records[-1]["loss"] < records[0]["loss"]


def test_big_config_trains_on_a_path_given_on_the_command_line(tmp_path):
    """configs/llama_1b.py reads synthetic tokens; --config.data.path alone (its docstring's advice)
    trains on the file instead. Shrunk by overrides to one small compile."""
    corpus = _text_file(tmp_path / "corpus.txt", size=200_000)
    shrink = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.num_heads=4",
              "--config.model.num_kv_heads=2", "--config.model.d_ff=128", "--config.model.vocab_size=256",
              "--config.train.steps=2", "--config.train.global_batch_size=8", "--config.train.seq_len=64",
              "--config.train.eval_every=0", "--config.train.log_every=1"]
    result = main_cli(["--config=configs/llama_1b.py", f"--config.data.path={corpus}", *shrink,
                       f"--workdir={tmp_path / 'run'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert data["source"] == "file" and data["path"] == str(corpus)
    tokens = int(re.search(r"([\d,]+) train tokens", result.stdout).group(1).replace(",", ""))
    assert 0.9 * 200_000 < tokens <= 200_001   # the file's bytes, less the held-out 5%: not synthetic tokens
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]


@pytest.mark.parametrize("family", ["gpt2"])
def test_gpt2_with_accumulation_and_remat(tiny_config, tmp_path, family):
    tiny_config.model.update(family=family, num_kv_heads=4, tie_embeddings=False, remat="full", max_seq_len=64)
    tiny_config.train.update(steps=4, grad_accum_steps=2, eval_every=0)
    tiny_config.data.source = "synthetic"
    records = train(tiny_config, tmp_path, show_progress=False)
    assert [r["step"] for r in records] == [1, 4] and "val_loss" not in records[-1]


def test_pipeline_cli_gives_unpipelined_first_loss(one_device_loss, tmp_path):
    """tiny.py's 2 layers as 2 stages of one layer (4 microbatches, data=4): one device's first loss."""
    result = main_cli(["--config=configs/tiny.py", "--config.train.steps=1", "--config.mesh.data=-1",
                       "--config.mesh.pipeline=2", "--config.pipeline.microbatches=4", f"--workdir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh data=4 pipeline=2" in result.stdout
    np.testing.assert_allclose(_records(tmp_path)[0]["loss"], one_device_loss, rtol=1e-5)
