"""Two processes x four CPU devices: each reads its own rows, and the run equals one process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import ROOT
from jaxscale import config as config_lib
from jaxscale.loop import train

OVERRIDES = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.d_ff=128", "model.dtype='float32'", "train.steps=6", "train.global_batch_size=16",
             "train.seq_len=32", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
             "metrics.tensorboard=False", "metrics.progress=False"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(workdir, port):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "mp_worker.py"), str(port), str(i),
                              str(workdir), json.dumps(OVERRIDES)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def test_two_processes_match_one(tmp_path):
    procs = _spawn(tmp_path / "mp", _free_port())
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "process 0 reads rows 0:8" in outputs[0] and "process 1 reads rows 8:16" in outputs[1]
    multi = [json.loads(line) for line in (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()]

    config = config_lib.defaults()
    config_lib.apply_overrides(config, OVERRIDES)
    single = train(config, tmp_path / "single", show_progress=False)
    assert [r["step"] for r in multi] == [r["step"] for r in single] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(multi, single):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(multi[-1]["val_loss"], single[-1]["val_loss"], rtol=1e-5)
