"""Two processes x four CPU devices: each reads its own rows, the run equals one process, its
checkpoint restores in one process, and SIGTERM to one process stops both at the same step."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from jaxscale import config as config_lib
from jaxscale.loop import train

OVERRIDES = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.d_ff=128", "model.dtype='float32'", "train.steps=6", "train.global_batch_size=16",
             "train.seq_len=32", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
             "metrics.tensorboard=False", "metrics.progress=False", "checkpoint.every_steps=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(workdir, port, overrides):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "mp_worker.py"), str(port), str(i),
                              str(workdir), json.dumps(overrides)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


HYBRID = ["mesh_dcn.data=2", "mesh.data=1", "mesh.fsdp=4", "zero_stage=1"]  # data crosses hosts, fsdp stays inside


@pytest.mark.parametrize("layout, single", [
    ([], []),
    (HYBRID, ["mesh.data=2", "mesh.fsdp=4", "zero_stage=1"]),
], ids=["data", "hybrid_dcn"])
def test_two_processes_match_one(tmp_path, layout, single):
    procs = _spawn(tmp_path / "mp", _free_port(), OVERRIDES + layout)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "process 0 reads rows 0:8" in outputs[0] and "process 1 reads rows 8:16" in outputs[1]
    multi = [json.loads(line) for line in (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()]

    config = config_lib.defaults()
    config_lib.apply_overrides(config, OVERRIDES + single)
    reference = train(config, tmp_path / "single", show_progress=False)
    assert [r["step"] for r in multi] == [r["step"] for r in reference] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(multi, reference):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(multi[-1]["val_loss"], reference[-1]["val_loss"], rtol=1e-5)
    # The 2-process checkpoint of step 3 continues in 1 process like the 2-process run did.
    config.checkpoint.resume_from = str(tmp_path / "mp" / "checkpoints" / "3")
    resumed = train(config, tmp_path / "from_mp", show_progress=False)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(multi[3:], resumed):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs = _spawn(tmp_path, _free_port(), OVERRIDES + ["train.steps=500", "checkpoint.every_steps=0"])
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs), [p.stdout.read()[-2000:] for p in procs]
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)  # as a scheduler preempting one host would
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 2 <= steps[0] < 500, outputs
    assert f"stopping after step {steps[0]}" in outputs[0] and "SIGTERM" in outputs[0]
    shards = {p.name for p in (tmp_path / "checkpoints" / str(steps[0]) / "state").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards  # both processes wrote their part of that step


def test_dcn_multipliers_must_match_the_hosts():
    config = config_lib.defaults()
    config_lib.apply_overrides(config, HYBRID)
    with pytest.raises(config_lib.ConfigError, match="1 hosts"):
        config_lib.validate(config, 8, granules=1)
    config_lib.validate(config, 8, granules=2)
