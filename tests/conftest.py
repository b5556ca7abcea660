"""Eight fake CPU devices for every test: set before jax is imported anywhere.

One persistent compilation cache per test session, shared with every process the tests start
(they inherit the environment): the CLI and multi-process tests compile the same few programs
again and again, and on 2 cores compiling is a large share of the suite's time.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Tests compile many small programs and run each a few steps: LLVM's optimisation passes cost far
# more compile time than they save run time here (test_step's layouts compiled in 0.6x the time,
# measured). The HLO, its buffers and its numerics are the same.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxscale-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def small_config():
    """A small, fast config: 2-layer llama, d_model 64, seq 32, batch 16, fp32."""
    from jaxscale.config import defaults

    config = defaults()
    config.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, dtype="float32")
    config.train.update(steps=20, global_batch_size=16, seq_len=32, log_every=5, eval_every=10, eval_batches=2)
    config.optim.update(lr=3e-3, warmup_steps=5)
    config.metrics.progress = False
    config.tracking.update(writers="jsonl", report=False)
    return config


@pytest.fixture
def tiny_config():
    return small_config()


def make_layout(devices: int | None = None, zero_stage: int = 0, **sizes):
    """A Layout over the first `devices` devices (default: the product of sizes) with default rules."""
    import math

    from jaxscale.mesh import AXES, make_mesh
    from jaxscale.sharding import Layout

    axes = {axis: sizes.get(axis, 1) for axis in AXES}
    count = devices or math.prod(axes.values())
    return Layout.of(make_mesh(axes, jax.devices()[:count]), zero_stage=zero_stage)


def cli_env(devices: int = 8) -> dict:
    """The environment of a fresh jaxscale process with `devices` fake CPU devices."""
    return dict(os.environ, XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def run_cli(args, devices: int = 8, cwd=ROOT, timeout: int = 300, module: str = "jaxscale.train"):
    """Run `python -m MODULE ARGS` in a fresh process with `devices` fake CPU devices."""
    import subprocess

    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(devices),
                          capture_output=True, text=True, timeout=timeout)


def start_cli(args, devices: int = 8, module: str = "jaxscale.train"):
    """Start `python -m MODULE ARGS` without waiting (stdout and stderr piped together)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=cli_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


assert jax.device_count() == 8, "tests expect 8 fake CPU devices; was jax imported before conftest?"
