"""Performance plumbing: a profiler window into the workdir, the step-time breakdown, compile
time and goodput in every record, the XLA flags set on GPUs and the malloc settings on CPUs."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from jaxscale.config import defaults
from jaxscale.runtime import cpu_malloc, xla_flags
from jaxscale.runtime.loop import train

WAIT_S, STEP_S, SAVE_S = 0.02, 0.02, 0.05  # sleeps added before each batch, step call and save


def _slowed(monkeypatch) -> None:
    """Every batch comes WAIT_S late, every call of the step and every checkpoint save take STEP_S
    and SAVE_S longer: lower bounds on each part of the step time that hold on any machine."""
    from jaxscale.data.loader import Data
    from jaxscale.runtime.session import Session

    batches, compiled, save = Data.train_batches, Session.compiled, Session.save

    def late_batches(self, start_step=0):
        for batch in batches(self, start_step):
            time.sleep(WAIT_S)
            yield batch

    def slow_step(self):
        step = compiled(self)
        return lambda *args: (time.sleep(STEP_S), step(*args))[1]

    monkeypatch.setattr(Data, "train_batches", late_batches)
    monkeypatch.setattr(Session, "compiled", slow_step)
    monkeypatch.setattr(Session, "save", lambda self, step: (time.sleep(SAVE_S), save(self, step))[1])


def _timed_stretches(monkeypatch) -> list[float]:
    """The wall time of each stretch of steps, by a clock outside the loop's (the stretch holds
    every logged window, and each window is measured once)."""
    from jaxscale.runtime import loop

    stretch, seconds = loop._stretch, []

    def timed(*args):
        began = time.perf_counter()
        try:
            return stretch(*args)
        finally:
            seconds.append(time.perf_counter() - began)

    monkeypatch.setattr(loop, "_stretch", timed)
    return seconds


def test_profile_window_and_step_time_breakdown(tiny_config, tmp_path, monkeypatch):
    """The records' step times, times the steps each covers, add up to no more than the stretch's
    wall time by an outside clock, and so do the three parts (a time counted twice, or per window
    instead of per step, exceeds it); each part is at least the sleep added to it."""
    tiny_config.train.update(steps=12, log_every=4, eval_every=0)
    tiny_config.checkpoint.every_steps = 6
    tiny_config.profile.update(start_step=5, steps=3)
    _slowed(monkeypatch)
    stretches = _timed_stretches(monkeypatch)
    records = train(tiny_config, tmp_path, show_progress=False)
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and list((tmp_path / "profile").rglob("*.trace.json.gz"))
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 0}, *records], records)]
    assert [r["step"] for r in records] == [1, 4, 8, 12] and len(stretches) == 1
    assert sum(r["step_time_s"] * n for r, n in zip(records, steps)) <= stretches[0]
    parts = sum((r["data_wait_s"] + r["checkpoint_block_s"] + r["device_step_s"]) * n for r, n in zip(records, steps))
    assert parts <= stretches[0]
    for r, n in zip(records, steps):
        saves = r["step"] // 6 - (r["step"] - n) // 6  # checkpoints at 6 and 12
        assert r["data_wait_s"] >= WAIT_S and r["device_step_s"] >= STEP_S, r
        assert r["checkpoint_block_s"] * n >= saves * SAVE_S and (r["checkpoint_block_s"] > 0) == bool(saves), r
        assert 0 < r["goodput"] < 1 and r["compile_s"] > 0
    assert records[-1]["goodput"] > records[0]["goodput"]  # start-up weighs less as the run goes on


def test_gpu_defaults_leave_the_users_flags_alone():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    got = xla_flags.with_defaults(mine)
    assert got.startswith(mine) and got.count("latency_hiding_scheduler") == 1
    assert all(f"--{name}=" in got for name in xla_flags.GPU_FLAGS)
    env = {"JAX_PLATFORMS": "cpu"}
    assert xla_flags.apply_gpu_defaults(defaults().xla, env) == [] and "XLA_FLAGS" not in env


def test_the_steps_compile_with_the_platforms_defaults_but_not_over_the_users():
    """The train and eval steps carry the defaults as compiler options (so a plan for a TPU or GPU
    target compiles what a run there does); a flag the user set in LIBTPU_INIT_ARGS or XLA_FLAGS,
    or the config's off switch, leaves them out; continuation fusions only on a v5e (libtpu 0.0.52
    refuses them elsewhere); a model with experts gets neither them nor the all-gather offload."""
    xla = defaults().xla
    v5e = dict(xla_flags.compiler_options(xla, "tpu", {}, device_kind="TPU v5 lite"))
    assert v5e == {**xla_flags.CONTINUATION_FUSIONS, **xla_flags.DENSE_OPTIONS}
    assert xla_flags.compiler_options(xla, "cpu", {}) == ()
    for kind in ("TPU v5", "TPU v6 lite", "TPU v4"):
        assert dict(xla_flags.compiler_options(xla, "tpu", {}, device_kind=kind)) == xla_flags.DENSE_OPTIONS
        # A mixture of experts compiles with the reduce-scatters offloaded alone.
        assert dict(xla_flags.compiler_options(xla, "tpu", {}, experts=True, device_kind=kind)) == \
            xla_flags.SPARSECORE_REDUCE_SCATTER
    assert dict(xla_flags.compiler_options(xla, "tpu", {}, experts=True, device_kind="TPU v5 lite")) == \
        xla_flags.SPARSECORE_REDUCE_SCATTER
    mine = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    mine_v5e = dict(xla_flags.compiler_options(xla, "tpu", mine, device_kind="TPU v5 lite"))
    assert "xla_enable_async_all_gather" not in mine_v5e and "xla_tpu_enable_async_collective_fusion" in mine_v5e
    gpu = dict(xla_flags.compiler_options(xla, "gpu", {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false"}))
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True and "xla_gpu_enable_pipelined_all_gather" not in gpu
    assert gpu["xla_gpu_all_reduce_combine_threshold_bytes"] == 128 * 2**20
    xla.tpu_defaults = xla.gpu_defaults = False
    assert xla_flags.compiler_options(xla, "tpu", {}) == () == xla_flags.compiler_options(xla, "gpu", {})


@pytest.mark.parametrize("extra, accepted", [("", True), ("--xla_gpu_no_such_flag=true", False)])
def test_the_installed_xla_knows_every_gpu_default(extra, accepted):
    """XLA aborts on an unknown flag; its CPU build parses the GPU flags too, so a jax upgrade that
    renames one fails here rather than on a GPU."""
    env = {"XLA_FLAGS": xla_flags.with_defaults(extra), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True)
    assert (done.returncode == 0) is accepted, done.stderr[-500:]


def test_cpu_malloc_settings_only_on_the_cpu_and_only_where_the_user_set_none():
    on, chose, cpu = defaults().xla, cpu_malloc.user_chose, cpu_malloc.cpu_expected
    assert cpu({"JAX_PLATFORMS": "cpu"}) and not cpu({"JAX_PLATFORMS": "cuda,cpu"})
    assert chose({"MALLOC_ARENA_MAX": "4"}) and chose({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert not chose({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "PATH": "/bin"})
    assert cpu_malloc.apply_cpu_defaults(on, {"JAX_PLATFORMS": "tpu"}) == []
    assert cpu_malloc.apply_cpu_defaults(on, {"JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "2"}) == []
    on.cpu_defaults = False
    assert cpu_malloc.apply_cpu_defaults(on, {"JAX_PLATFORMS": "cpu"}) == []


def _scratch_faults(*modes: str) -> list[dict]:
    """tests/scratch_faults.py in each mode, side by side; XLA's own optimisation (not the suite's
    -O0, under which this program's running sums run 20x slower)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "XLA_FLAGS"))} | {"JAX_PLATFORMS": "cpu"}
    runs = [subprocess.Popen([sys.executable, "tests/scratch_faults.py", m], env=env, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for m in modes]
    outs = [run.communicate() for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-500:] for _, err in outs]
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


@pytest.mark.serial  # page faults: run alone, as they were measured
def test_cpu_malloc_settings_stop_the_page_faults_of_xla_cpus_scratch_buffer():
    """glibc mmaps a scratch buffer this large afresh for every execution: a fault per page. In
    the heap the same pages serve every call; given back to mmap (fit_scratch after the compile),
    the faults return. (fit_scratch called after executions once raced the last call's free,
    79 and 47 faults instead of about 16,900.)"""
    off, on, large = _scratch_faults("off", "on", "on,large")
    pages = off["scratch"] / 4096
    assert off["scratch"] > 40 * 2**20 and off["made"] == [] and off["faults"] > pages / 2
    assert on["made"] == large["made"] == ["M_MMAP_MAX=0", "M_TRIM_THRESHOLD=2147483647", "M_ARENA_MAX=1"]
    assert on["faults"] < pages / 100
    assert "back to the system" in large["note"] and large["left"] == ["M_ARENA_MAX=1"] and large["faults"] > pages / 2
