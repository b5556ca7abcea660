"""Performance plumbing: a profiler window into the workdir, the step-time breakdown, compile
time and goodput in every record, and the XLA flags set on GPUs."""

import subprocess
import sys

import pytest

from jaxscale import xla_flags
from jaxscale.config import defaults
from jaxscale.loop import train


def test_profile_window_and_step_time_breakdown(tiny_config, tmp_path):
    tiny_config.train.update(steps=12, log_every=4, eval_every=0)
    tiny_config.checkpoint.every_steps = 6
    tiny_config.profile.update(start_step=5, steps=3)
    records = train(tiny_config, tmp_path, show_progress=False)
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and list((tmp_path / "profile").rglob("*.trace.json.gz"))
    for r in records:
        parts = r["data_wait_s"] + r["checkpoint_block_s"] + r["device_step_s"]
        assert r["step_time_s"] == pytest.approx(parts) and min(r["data_wait_s"], r["device_step_s"]) > 0
        assert 0 < r["goodput"] < 1 and r["compile_s"] > 0
    assert [r["checkpoint_block_s"] > 0 for r in records] == [False, False, True, True]  # saves at 6 and 12
    assert records[-1]["goodput"] > records[0]["goodput"]  # start-up weighs less as the run goes on


def test_gpu_defaults_leave_the_users_flags_alone():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    got = xla_flags.with_defaults(mine)
    assert got.startswith(mine) and got.count("latency_hiding_scheduler") == 1
    assert all(f"--{name}=" in got for name in xla_flags.GPU_FLAGS)
    env = {"JAX_PLATFORMS": "cpu"}
    assert xla_flags.apply_gpu_defaults(defaults().xla, env) == [] and "XLA_FLAGS" not in env


@pytest.mark.parametrize("extra, accepted", [("", True), ("--xla_gpu_no_such_flag=true", False)])
def test_the_installed_xla_knows_every_gpu_default(extra, accepted):
    """XLA aborts on an unknown flag; its CPU build parses the GPU flags too, so a jax upgrade that
    renames one fails here rather than on a GPU."""
    env = {"XLA_FLAGS": xla_flags.with_defaults(extra), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True)
    assert (done.returncode == 0) is accepted, done.stderr[-500:]
