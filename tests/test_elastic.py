"""The launcher restarts a job with the processes that remain: 4 processes x 2 CPU devices, one
killed (SIGKILL, as a lost host) mid-run; 3 start again, resume from host memory (local
checkpoints: at most the steps since the last local copy are lost) on 6 devices and finish, with
the losses of an uninterrupted 6-device run from the last persistent checkpoint."""

import json
import shutil
import subprocess
import sys

import numpy as np

from conftest import ROOT, cli_env, run_cli

STEPS = 20
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


def _run_killing_one(workdir, at_step: int, extra=(), after_kill=lambda: None) -> tuple[list[str], int]:
    """(the launcher's output lines, the step the restarted job resumed from): 4 processes x 2
    devices, the last one SIGKILLed once step `at_step` is reported, then `after_kill()`."""
    cmd = [sys.executable, "-m", "jaxscale.launch", "--nproc=4", "--devices_per_proc=2", "--max_restarts=1",
           "--min_nproc=3", "--", sys.executable, "-m", "jaxscale.train", *_train_args(workdir),
           *(f"--config.{o}" for o in extra)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    out = []
    for line in launcher.stdout:
        out.append(line)
        if line.startswith(f"[0] step {at_step} "):
            children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
            subprocess.run(["kill", "-9", max(children.split(), key=int)])
            after_kill()
            break
    out += launcher.stdout.readlines()
    text = "".join(out)
    assert launcher.wait(timeout=600) == 0, text[-3000:]
    found = [line for line in out if "jaxscale.launch: restart 1/1" in line]
    assert len(found) == 1 and "were killed (lost); starting 3 processes" in found[0], text[-3000:]
    said = next(line for line in out if "resuming from step " in line)
    return out, int(said.split("resuming from step ")[1].split()[0])


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


def test_a_lost_host_restarts_the_job_from_local_checkpoints_as_an_uninterrupted_run(tmp_path):
    """ZeRO-3 (each process holds a quarter of the state); local copies every 2 steps, persistent
    every 10, one directory per process as on separate hosts; process 3 is killed at step 15 and
    its copies go with it: the 3 left restore the newest local step from their own blocks and
    process 0's replica of process 3's, not step 10, and finish on 6 devices with the losses of an
    uninterrupted 6-device run from the persistent step 10."""
    workdir, local = tmp_path / "job", tmp_path / "local"
    extra = ["zero_stage=3", "checkpoint.every_steps=10"]
    out, resumed = _run_killing_one(workdir, at_step=15, after_kill=lambda: shutil.rmtree(local / "host3"),
                                    extra=[*extra, "checkpoint.local_every_steps=2",
                                           f"checkpoint.local_dir='{local}/host{{process}}'"])
    text = "".join(out)
    assert resumed >= 13, text[-3000:]  # at most 2 steps lost
    assert any(f"restored step {resumed} from the local checkpoints of 3 of 3 processes" in line for line in out), \
        text[-3000:]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first, last = ({r["step"]: r["loss"] for r in order if "loss" in r} for order in (records[::-1], records))
    # The step after the resume computes what the killed job computed (8 devices then, 6 now).
    np.testing.assert_allclose(last[resumed + 1], first[resumed + 1], rtol=1e-5)
    assert not any(local.iterdir())  # the finished job's copies are gone
    # An uninterrupted run of the same global batch on 6 devices from the persistent step 10.
    reference = tmp_path / "reference"
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(workdir / "checkpoints" / "10", reference / "checkpoints" / "10")
    done = run_cli([*_train_args(reference), *(f"--config.{o}" for o in extra)], devices=6)
    assert done.returncode == 0, done.stderr[-3000:]
    want = _losses(reference)
    assert sorted(want) == list(range(11, STEPS + 1))
    np.testing.assert_allclose([last[s] for s in range(resumed + 1, STEPS + 1)],
                               [want[s] for s in range(resumed + 1, STEPS + 1)], rtol=1e-5)
