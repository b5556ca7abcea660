"""Faults with real processes and real signals, no mocks: SIGTERM and SIGINT mid-run, SIGKILL
during an asynchronous save, and a disk that fills up during a save."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST_RUN, ROOT, cli_env, run_cli, start_cli

# Every run here takes tens of steps, so all compile for running (conftest.FAST_RUN), alike for the
# runs each test compares.
TINY = ["--config=configs/tiny.py", "--config.train.eval_every=0", "--config.tracking.writers=jsonl",
        "--config.tracking.report=False"]


def _records(workdir):
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _last_per_step(records):
    """A resumed run logs again the steps after its checkpoint; the latest record of a step wins."""
    return {r["step"]: r for r in records}


def _committed(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _wait_for(condition, proc, timeout=240, poll=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the fault (exit {proc.returncode}):\n"
                                 f"{proc.stdout.read()[-3000:]}")
        found = condition()
        if found:
            return found
        time.sleep(poll)
    raise AssertionError("timed out waiting for the moment to inject the fault")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted 20-step run, one record per step."""
    workdir = tmp_path_factory.mktemp("whole")
    result = run_cli([*TINY, "--config.train.steps=20", "--config.train.log_every=1", f"--workdir={workdir}"],
                     flags=FAST_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return _last_per_step(_records(workdir))


def _stop_with(sig, at_step: int, args: list[str], workdir) -> int:
    """Start the run, send `sig` once step `at_step` is logged: the step it saved and stopped after."""
    proc = start_cli(args, flags=FAST_RUN)
    _wait_for(lambda: any(r["step"] >= at_step for r in _records(workdir)), proc, poll=0.002)
    proc.send_signal(sig)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    stopped = max(_committed(workdir))
    assert at_step <= stopped < 20, out[-2000:]
    assert f"{sig.name}: stopping after step {stopped}" in out and f"checkpoint of step {stopped} committed" in out
    return stopped


def test_a_signal_saves_and_the_same_command_resumes_bit_identically(whole, tmp_path):
    args = [*TINY, "--config.train.steps=20", "--config.train.log_every=1", f"--workdir={tmp_path}"]
    stopped = _stop_with(signal.SIGTERM, 10, args, tmp_path)
    resumed = run_cli(args, flags=FAST_RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step {stopped}" in resumed.stdout
    merged = _last_per_step(_records(tmp_path))
    assert sorted(merged) == list(range(1, 21))
    for step in range(11, 21):  # bit-identical: compared with ==
        assert (merged[step]["loss"], merged[step]["grad_norm"]) == (whole[step]["loss"], whole[step]["grad_norm"])


def test_ctrl_c_saves_as_sigterm_does(tmp_path):
    """SIGINT takes SIGTERM's path (jaxscale.runtime.preemption): a checkpoint of the step it
    stopped after, exit 0; resuming from it is the test above."""
    _stop_with(signal.SIGINT, 3, [*TINY, "--config.train.steps=20", "--config.train.log_every=1",
                                  f"--workdir={tmp_path}"], tmp_path)


# ~17M parameters (about 200 MB of state with Adam): a save takes long enough to be killed in.
BIG = [*TINY, "--config.model.d_model=512", "--config.model.d_ff=2048", "--config.model.num_layers=4",
       "--config.model.num_heads=8", "--config.model.num_kv_heads=8", "--config.train.global_batch_size=4",
       "--config.train.seq_len=16", "--config.checkpoint.every_steps=2", "--config.train.log_every=1"]


def test_sigkill_during_an_async_save_resumes_from_the_previous_step(tmp_path):
    proc = start_cli([*BIG, "--config.train.steps=1000", f"--workdir={tmp_path}"], devices=1, flags=FAST_RUN)
    ckpts = tmp_path / "checkpoints"

    def saving_after_a_commit():
        tmp = [p for p in ckpts.glob("*.orbax-checkpoint-tmp*")] if ckpts.exists() else []
        return tmp if tmp and _committed(tmp_path) else None

    tmp = _wait_for(saving_after_a_commit, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    killed = int(tmp[0].name.split(".")[0])
    before = _committed(tmp_path)
    assert killed not in before and max(before) < killed  # the half-written step never became a step
    resumed = run_cli([*BIG, f"--config.train.steps={killed + 1}", f"--workdir={tmp_path}"], devices=1, flags=FAST_RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step {max(before)}" in resumed.stdout
    assert killed + 1 in _committed(tmp_path)
    assert not list(ckpts.glob("*tmp*"))  # the leftover was cleaned up


CHECK = """
import sys
from jaxscale import cli
from jaxscale.checkpoint import Checkpointer
from jaxscale.build import build
config = cli.load_config("configs/tiny.py", [])
run = build(config)
restored = Checkpointer(sys.argv[1], config.checkpoint).restore(run.abstract_state)
print("restored step", restored.step, "global sample", restored.position["global_sample"])
"""


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare and a tmpfs mount in a user namespace")
def test_a_full_disk_is_reported_and_the_previous_checkpoint_stays_intact(tmp_path):
    """An 8 MiB tmpfs holds the first checkpoint (about 5 MB) but not the second."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train = [sys.executable, "-m", "jaxscale.train", *TINY, "--config.train.steps=20",
             "--config.checkpoint.every_steps=5", f"--workdir={disk}/run"]
    script = (f"mount -t tmpfs -o size=8m tmpfs {disk} && "
              f"{' '.join(train)} > {tmp_path}/out 2> {tmp_path}/err; echo $? > {tmp_path}/rc; "
              f"{sys.executable} -c '{CHECK}' {disk}/run/checkpoints > {tmp_path}/check 2>&1")
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT,
                   env=cli_env(1, FAST_RUN), timeout=300, check=True)
    err = (tmp_path / "err").read_text().strip().splitlines()
    assert (tmp_path / "rc").read_text().strip() == "1", err
    assert err[-1].startswith("jaxscale: error: checkpoint step 10 could not be written"), err[-5:]
    assert "No space left on device" in err[-1] and "step 5 is the latest intact checkpoint" in err[-1]
    assert "restored step 5 global sample 80" in (tmp_path / "check").read_text()


QUIET = """
import asyncio, logging, sys
from jaxscale.checkpoint import quiet
logging.basicConfig()
loop = asyncio.new_event_loop()
loop.close()
quiet.closed_loops()
class Late:  # a callback's error Python cannot raise anywhere, as TensorStore's late completions
    def __init__(self, call): self.call = call
    def __del__(self): self.call()
def kept(): raise RuntimeError("kept")
Late(lambda: loop.call_soon_threadsafe(print))
Late(kept)
logging.getLogger("absl").error("before")
quiet.after_reported_failure()
logging.getLogger("absl").error("after")
async def fails():
    raise ValueError("never retrieved")
late = asyncio.new_event_loop()
task = late.create_task(fails())
late.run_until_complete(asyncio.sleep(0))  # the task ran and failed; nobody awaits it
del task  # asyncio logs "Task exception was never retrieved" when it is collected
Late(kept)  # an unraisable error after the failure
import threading
worker = threading.Thread(target=kept)
worker.start()
worker.join()
print("jaxscale: error: last", file=sys.stderr)
"""


def test_after_a_reported_failure_orbax_and_closed_loops_say_nothing_more():
    """What the full-disk run above sees only on a loaded machine: late reports, dropped."""
    out = subprocess.run([sys.executable, "-c", QUIET], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert "Event loop is closed" not in out.stderr and "RuntimeError: kept" in out.stderr
    assert "ERROR:absl:before" in lines and "ERROR:absl:after" not in lines
    assert "never retrieved" not in out.stderr and out.stderr.count("RuntimeError: kept") == 1
    assert lines[-1] == "jaxscale: error: last"
