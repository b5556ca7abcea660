"""Two processes x four CPU devices, joined by jax.distributed as on two hosts: through
`python -m jaxscale.launch`, or started one by one as a scheduler would. Each reads only its
rows; the job equals one process; checkpoints move between 1 and 2 processes; a signal, a death
or a hang of one process ends the job in bounded time (and the watchdog behind that, in process)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, cli_env
from jaxscale import cli
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.launch import _free_port, child_env
from jaxscale.runtime.health import Watchdog
from jaxscale.runtime.loop import train
from jaxscale.validate import validate

OVERRIDES = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.d_ff=128", "model.dtype='float32'", "train.steps=6", "train.global_batch_size=16",
             "train.seq_len=32", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
             "tracking.writers=jsonl", "tracking.report=False", "metrics.progress=False", "checkpoint.every_steps=3"]
HYBRID = ["mesh_dcn.data=2", "mesh.data=1", "mesh.fsdp=4", "zero_stage=1"]  # data crosses hosts, fsdp stays inside


def _train_cmd(workdir, overrides):
    return [sys.executable, "-m", "jaxscale.train", "--config=configs/tiny.py", f"--workdir={workdir}",
            *(f"--config.{o}" for o in overrides)]


def _launch(workdir, overrides, timeout=300, nproc=2):
    cmd = [sys.executable, "-m", "jaxscale.launch", f"--nproc={nproc}", "--devices_per_proc=4", "--",
           *_train_cmd(workdir, overrides)]
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def _spawn(workdir, overrides, env=None):
    """Two processes started one by one, as a scheduler would, each with its own log file."""
    port = _free_port()
    env = env or cli_env()
    return [subprocess.Popen(_train_cmd(workdir, overrides), cwd=ROOT, env=child_env(i, 2, port, 4, env),
                             stdout=open(f"{workdir}.{i}.log", "w"), stderr=subprocess.STDOUT) for i in range(2)]


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _single(overrides):
    """The launched processes' config (configs/tiny.py with the overrides), for a run in this process."""
    return cli.load_config(str(ROOT / "configs" / "tiny.py"), OVERRIDES + overrides)


def _close(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x["loss"], y["loss"], rtol=1e-5)


@pytest.mark.parametrize("layout, single", [
    ([], []),
    (HYBRID, ["mesh.data=2", "mesh.fsdp=4", "zero_stage=1"]),
], ids=["data", "hybrid_dcn"])
def test_two_processes_match_one(tmp_path, layout, single):
    done = _launch(tmp_path / "mp", OVERRIDES + layout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[0] process 0 of 2: 4 devices, reads rows 0:8" in done.stdout
    assert "[1] process 1 of 2: 4 devices, reads rows 8:16" in done.stdout
    # The pre-flight checks ran first: every device answered, the directory, an all-reduce per axis.
    axes = "data=2 .* GB/s, fsdp=4 .* GB/s" if layout else "data=8 .* GB/s"
    assert re.search(r"\[0\] preflight: 2 processes, 8 devices answered; checkpoint directory writable; "
                     rf"all-reduce bus bandwidth {axes}\n", done.stdout), done.stdout[-3000:]
    multi = _records(tmp_path / "mp")
    reference = train(_single(single), tmp_path / "single", show_progress=False)
    assert [r["step"] for r in multi] == [1, 2, 3, 4, 5, 6]
    _close(multi, reference)
    np.testing.assert_allclose(multi[-1]["val_loss"], reference[-1]["val_loss"], rtol=1e-5)
    if layout:
        return
    # Checkpoints of step 3 continue like the run that wrote them: from 2 processes in 1, and back.
    config = _single(["checkpoint.resume_from=" + str(tmp_path / "mp" / "checkpoints" / "3")])
    _close(train(config, tmp_path / "mp_to_one", show_progress=False), multi[3:])
    resume = f"checkpoint.resume_from={tmp_path / 'single' / 'checkpoints' / '3'}"
    back = _launch(tmp_path / "one_to_mp", OVERRIDES + [resume])
    assert back.returncode == 0, back.stdout[-3000:]
    _close(_records(tmp_path / "one_to_mp"), reference[3:])


def test_sigterm_to_the_launcher_saves_and_exits_0(tmp_path):
    cmd = [sys.executable, "-m", "jaxscale.launch", "--nproc=2", "--devices_per_proc=4", "--",
           *_train_cmd(tmp_path, OVERRIDES + ["train.steps=500", "checkpoint.every_steps=0"])]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    while not ((tmp_path / "metrics.jsonl").exists() and len(_records(tmp_path)) >= 2):
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        time.sleep(0.01)
    launcher.send_signal(signal.SIGTERM)
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 0, out[-3000:]
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 2 <= steps[0] < 500
    assert f"[0] SIGTERM: stopping after step {steps[0]}" in out and f"checkpoint of step {steps[0]} committed" in out
    shards = {p.name for p in (tmp_path / "checkpoints" / str(steps[0]) / "state").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards  # both processes wrote their part of that step


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs = _spawn(tmp_path, OVERRIDES + ["train.steps=500", "checkpoint.every_steps=0"])
    while not ((tmp_path / "metrics.jsonl").exists() and len(_records(tmp_path)) >= 2):
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)  # as a scheduler preempting one host would
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 2 <= steps[0] < 500
    assert f"stopping after step {steps[0]}" in (tmp_path.parent / f"{tmp_path.name}.0.log").read_text()


def _started(workdir, procs, records: int = 2):
    while not ((workdir / "metrics.jsonl").exists() and len(_records(workdir)) >= records):
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.02)


WATCHDOG_S = 10.0
POLL_S = 1.0  # how often the watchdog looks (health.Watchdog's default)


@pytest.mark.parametrize("fault, heartbeat_s", [(signal.SIGKILL, 10), (signal.SIGSTOP, 100)], ids=["killed", "hung"])
def test_a_dead_or_hung_process_ends_the_other_in_bounded_time(tmp_path, fault, heartbeat_s):
    """The other process ends within the watchdog's deadline (or the heartbeat's) and a poll, plus
    a margin of 10x what the rest takes; its healthy steps, timed before the fault, stay 10x inside
    the deadline. No evaluation: its first call compiles, a pause no step makes."""
    settings = [f"distributed.heartbeat_timeout_s={heartbeat_s}", f"distributed.watchdog_seconds={WATCHDOG_S}",
                "train.steps=100000", "checkpoint.every_steps=0", "train.eval_every=0"]
    # Both compile from scratch: JAX's persistent cache takes entries from process 0 only, so after
    # an earlier run process 0 would start tens of seconds ahead of process 1, and under load past
    # the 30 s the CPU collectives (Gloo) wait for the other process at the first step.
    procs = _spawn(tmp_path, OVERRIDES + settings, dict(cli_env(), JAX_ENABLE_COMPILATION_CACHE="false"))
    try:
        _started(tmp_path, procs, records=5)
        # A record's step time runs to just before its metrics are fetched, so step 2's holds the
        # wait for step 1, where the processes meet (27 s once, under load). From step 3 on they
        # time what the armed watchdog sees.
        slowest = max(r["step_time_s"] for r in _records(tmp_path)[2:])
        assert 10 * slowest < WATCHDOG_S, f"a step took {slowest:.1f}s: too slow to tell from a hang"
        began = time.monotonic()
        procs[1].send_signal(fault)
        code = procs[0].wait(timeout=10 * (WATCHDOG_S + POLL_S))
        took = time.monotonic() - began
    finally:
        for p in procs:
            p.kill()
    log = (tmp_path.parent / f"{tmp_path.name}.0.log").read_text()
    assert code != 0 and took < WATCHDOG_S + 10 * (POLL_S + slowest), (code, took, log[-2000:])
    if fault == signal.SIGSTOP:  # the watchdog, not the heartbeat, ended it: with every thread's stack
        assert "no step completed for" in log and "(most recent call first)" in log, log[-2000:]
        assert took > WATCHDOG_S / 2, (took, log[-2000:])  # not before its deadline


def test_the_watchdog_arms_once_steps_flow(monkeypatch):
    """No deadline until the second beat (the first step waits for every process to arrive); then
    a stall ends the process. Waits are 10x the deadline either way, so load cannot flip them."""
    expired = threading.Event()
    monkeypatch.setattr(Watchdog, "_expire", lambda self, idle: expired.set())
    deadline = 0.1
    dog = Watchdog(deadline).start()
    try:
        assert not expired.wait(10 * deadline) and not dog.armed  # set up, compiling: no steps yet
        dog.beat(1)
        assert not expired.wait(10 * deadline) and not dog.armed  # the first step, waiting for the others
        dog.beat(2)
        assert dog.armed and expired.wait(100 * deadline)  # steps flowed, then stopped
    finally:
        dog.stop()
    assert not dog.armed


def test_the_launcher_stops_the_others_when_one_fails(tmp_path):
    cmd = [sys.executable, "-m", "jaxscale.launch", "--nproc=2", "--devices_per_proc=4", "--grace_s=2", "--",
           *_train_cmd(tmp_path, OVERRIDES + ["train.steps=100000", "distributed.heartbeat_timeout_s=100"])]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    _started(tmp_path, [launcher])
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    began = time.monotonic()
    subprocess.run(["kill", "-9", max(children, key=int)])
    out = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 137 and time.monotonic() - began < 20, out[-2000:]
    assert "exited with -9; stopping the others" in out
    assert not subprocess.run(["pgrep", "-f", f"workdir={tmp_path}"], capture_output=True).stdout


def test_dcn_multipliers_must_match_the_hosts():
    config = config_lib.defaults()
    config_lib.apply_overrides(config, HYBRID)
    with pytest.raises(ConfigError, match="1 hosts"):
        validate(config, 8, granules=1)
    validate(config, 8, granules=2)


@pytest.mark.serial  # other tests' load on the cores would blur the slowdown it creates
def test_a_slowed_process_is_reported_as_a_straggler(tmp_path):
    """Once training runs, process 1 runs 5 ms of every 35 (SIGSTOP/SIGCONT), as a host with a
    seventh of its CPU would. The probe's compute (tens of ms on CPU) cannot fit in a 5 ms window,
    so every timed repeat holds a 30 ms pause: far above the 20% threshold whatever the phase. (A
    10 ms window and a few-ms probe let repeats fall between pauses, and a CI run missed the report.)
    Two exchanges, at steps 5 and 10, both throttled; each one alone is enough (measured: 142-300%
    above the median at every exchange, two runs)."""
    procs = _spawn(tmp_path, OVERRIDES + ["train.steps=10", "train.log_every=1", "train.eval_every=0",
                                          "checkpoint.every_steps=0", "distributed.straggler_every=5"])
    done = threading.Event()

    def throttle(pid: int) -> None:
        while not done.wait(0.01):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            done.wait(0.03)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    throttler = threading.Thread(target=throttle, args=(procs[1].pid,), daemon=True)
    try:
        _started(tmp_path, procs)
        throttler.start()
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        done.set()
        if throttler.is_alive():
            throttler.join()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
    log = (tmp_path.parent / f"{tmp_path.name}.0.log").read_text()
    assert "straggler: process 1's local device probe" in log, log[-2000:]
