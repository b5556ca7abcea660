"""The launcher restarts a job with the processes that remain: 4 processes x 2 CPU devices, one
killed (SIGKILL, as a lost host) mid-run; 3 start again, resume the last checkpoint on 6 devices
and finish, with the losses of an uninterrupted run resumed from that step."""

import json
import shutil
import subprocess
import sys

import numpy as np

from conftest import ROOT, cli_env, run_cli

STEPS = 30
OVERRIDES = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2", "model.d_ff=128",
             "model.dtype='float32'", f"train.steps={STEPS}", "train.global_batch_size=24", "train.seq_len=32",
             "train.log_every=1", "train.eval_every=0", "tracking.writers=jsonl", "tracking.report=False",
             "checkpoint.every_steps=5", "checkpoint.max_to_keep=10"]


def _train_args(workdir):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", *(f"--config.{o}" for o in OVERRIDES)]


def _losses(workdir) -> dict:
    """{step: loss}, the last record of each step (a resumed run writes its steps again)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_killed_process_restarts_the_job_with_the_others(tmp_path):
    workdir = tmp_path / "job"
    cmd = [sys.executable, "-m", "jaxscale.launch", "--nproc=4", "--devices_per_proc=2", "--max_restarts=1",
           "--min_nproc=3", "--", sys.executable, "-m", "jaxscale.train", *_train_args(workdir)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    out = []
    for line in launcher.stdout:  # kill one process once step 7 is reported
        out.append(line)
        if line.startswith("[0] step 7 "):
            children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
            subprocess.run(["kill", "-9", max(children.split(), key=int)])
            break
    out += launcher.stdout.readlines()
    text = "".join(out)
    assert launcher.wait(timeout=600) == 0, text[-3000:]
    found = [line for line in out if "jaxscale.launch: restart 1/1" in line]
    assert len(found) == 1 and "were killed (lost); starting 3 processes" in found[0], text[-3000:]
    # The restarted job resumed the last checkpoint before the kill and finished on 6 devices.
    said = next(line for line in out if "resuming from step " in line)
    resumed = int(said.split("resuming from step ")[1].split()[0])
    assert 5 <= resumed < STEPS and resumed % 5 == 0
    # An uninterrupted run of the same global batch on 6 devices from that checkpoint.
    reference = tmp_path / "reference"
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(workdir / "checkpoints" / str(resumed), reference / "checkpoints" / str(resumed))
    done = run_cli(_train_args(reference), devices=6)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = _losses(workdir), _losses(reference)
    assert sorted(want) == list(range(resumed + 1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)], rtol=1e-5)


def test_a_device_that_answers_wrong_stops_the_job_before_it_compiles(tmp_path):
    cmd = [sys.executable, "-m", "jaxscale.launch", "--nproc=2", "--devices_per_proc=2", "--",
           sys.executable, "-m", "jaxscale.train", *_train_args(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env={**cli_env(), "JAXSCALE_PREFLIGHT_INJECT": "wrong_answer@1"},
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out[-3000:]  # the pre-flight exit code, from the process that failed first
    errors = [line for line in out.splitlines() if "jaxscale: error: preflight failed" in line]
    assert len(errors) == 2, out[-3000:]  # every process stops, naming the same culprit
    assert all("process 1: its device 0 (id " in line and "computed a wrong answer" in line for line in errors), errors
    assert "compiled the train step" not in out and not (tmp_path / "metrics.jsonl").exists()
