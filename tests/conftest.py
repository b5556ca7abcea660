"""Eight fake CPU devices for every test: set before jax is imported anywhere.

One persistent compilation cache per test session, shared with every process the tests start
(they inherit the environment): the CLI and multi-process tests compile the same few programs
again and again, and on 2 cores compiling is a large share of the suite's time.
"""

import atexit
import contextlib
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Tests compile many small programs and run each a few steps. LLVM's optimisation passes cost far
# more compile time than they save run time here, and XLA:CPU's MLIR fusion emitters compile a
# train step 4x slower than its classic IR emitters (2.5 s against 0.6 s for test_step's 2-layer
# model at -O0), measured. The HLO and its buffers are the same; each test compares programs
# compiled with the same flags. A test that runs a hundred steps takes FAST_RUN instead: -O1
# compiles slower but runs tiny.py's step in 171 ms against 480 ms at -O0 (measured). Both compile
# each program's LLVM module whole, on one thread (split_count=1): XLA:CPU splits it for parallel
# code generation by default, which on 2 cores shared by 3 test workers costs more CPU than it
# saves (tests/test_step.py alone: 135 against 164 CPU-seconds, test_model.py 38 against 45, measured).
ONE_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                f"--xla_cpu_use_fusion_emitters=false {ONE_MODULE}")
FAST_RUN = f"--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false {ONE_MODULE}"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxscale-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

# A worker's heap grows with every module it imports and every program JAX caches, and Python's
# cycle collector walks it again and again while JAX traces (each trace allocates many small
# objects): at the default thresholds that took 11% of test_moe.py's time (184 s of CPU against
# 159-166 s with these, measured). Collect young objects 70x less often, and take everything
# imported at collection out of the collector's walk (gc.freeze).
gc.set_threshold(50_000, 20, 100)


# `make test` hands whole files to its two workers in this order (--no-loadscope-reorder): the
# files that took longest (15-150 s each on the 2-core VM, measured) first, the short ones after,
# so that neither worker is left running a long file alone at the end while the other waits.
LONGEST_FIRST = ("test_benchmarks", "test_step", "test_moe", "test_multiprocess", "test_topology", "test_interop",
                 "test_faults", "test_notebook", "test_elastic", "test_plan", "test_gpu_topology", "test_docs",
                 "test_train", "test_model", "test_context", "test_fp8", "test_checkpoint", "test_preference",
                 "test_prediction", "test_tracking", "test_generate", "test_search", "test_pipeline", "test_vocab",
                 "test_convert", "test_masks")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


ROOT = Path(__file__).resolve().parents[1]


class LazyModule:
    """`pytest.importorskip(name)` on first use, from inside the test that uses it. Every pytest
    worker collects every test file, but each file runs on one worker: imported at collection,
    torch, transformers and mlflow (8.5 s of CPU together, measured) were loaded by all of them."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        # pytest looks up fixture markers and `__wrapped__` on every module attribute while it
        # collects: answering those would import the module there (4 s a worker, measured).
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name), attr)


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


def build_for(spec, *, optim=None, accum: int = 1, rows: int = 32, seq_len: int = 32, dtype: str = "float32",
              zero_stage: int = 0, sequence_parallel: bool = False, devices: int | None = None,
              schedule: str = "gpipe", microbatches: int = 1, virtual_stages: int = 1, context: str = "ring",
              schedule_file: str = "", overlap: str = "off", collective_matmul: str = "auto", **sizes):
    """`build()` of the config that describes the ModelSpec `spec` (its strategy and weights set
    by the layout and `dtype`), on the mesh `sizes` over the first `devices` devices (default: the
    product of sizes). The run's model is checked to be `spec`: every field maps to a config key."""
    import dataclasses
    import math

    from jaxscale.build import build
    from jaxscale.config import defaults
    from jaxscale.guard import GuardSpec
    from jaxscale.mesh import AXES

    config = defaults()
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    nested = ("moe", "rope_scaling", "mla", "lora")
    config.model.update({k: v for k, v in fields.items() if k in config.model and k not in nested})
    for name in nested:
        config.model[name].update(dataclasses.asdict(fields[name]))
    config.model.attention.update(impl=spec.attention_impl, block_size=spec.attention_block, context_parallel=context)
    config.model.update(dtype=dtype, layer_loop="scan" if spec.scan_layers else "unroll",
                        projections="cpu" if spec.cpu_matmul else "einsum")
    axes = {axis: sizes.pop(axis, 1) for axis in AXES}
    assert not sizes, f"not mesh axes: {sorted(sizes)}"
    config.mesh.update(axes)
    config.update(zero_stage=zero_stage)
    config.sharding.update(sequence_parallel=sequence_parallel, overlap=overlap, collective_matmul=collective_matmul)
    config.train.update(steps=10, global_batch_size=rows, seq_len=seq_len, grad_accum_steps=accum)
    config.optim = optim if optim is not None else config.optim
    config.pipeline.update(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                           schedule_file=schedule_file)
    run = build(config, jax.devices()[:devices or math.prod(axes.values())])
    got = dataclasses.replace(run.model.spec, strategy=spec.strategy, weights=spec.weights)
    assert got == spec and run.guard == GuardSpec(), (got, spec)
    return run


_INITIAL_STATES = {}


def initial_state(run, key):
    """`run.init_state()`'s state, without compiling an init program per layout: the initial
    state is a pure function of the seed, so it is made once per `key` (naming the model spec and
    the optimizer settings) on one device and placed on each run's shardings."""
    from jaxscale import state as state_lib

    if key not in _INITIAL_STATES:
        plain, tx = run.model.unsharded(), run.step_spec.tx
        _INITIAL_STATES[key] = jax.device_get(jax.jit(lambda: state_lib.create(plain, tx, 0, run.guard))())
    return jax.device_put(_INITIAL_STATES[key], run.shardings)


def sent_by_axis(plan: dict) -> dict[tuple[str, str], float]:
    """A plan's collectives as {(kind, mesh axes): bytes each device sends per step}."""
    return {(kind, axes): row["sent_bytes"] for kind, over in plan["collectives_by_axis"].items()
            for axes, row in over.items()}


def cli_env(devices: int = 8, flags: str = FAST_COMPILE) -> dict:
    """The environment of a fresh jaxscale process with `devices` fake CPU devices, compiling with
    XLA `flags`: FAST_RUN for a run of tens of steps (tiny.py, 50 steps on 8 devices: 20 s wall,
    30 s CPU against 33 s and 56 s with FAST_COMPILE, measured)."""
    return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _command(module: str, args) -> list[str]:
    """`python -m MODULE ARGS`; a training run draws no report unless the test names
    tracking.report (drawing it takes 2.6 s of a one-step run; test_tracking checks it)."""
    no_report = module == "jaxscale.train" and not any("tracking.report" in a for a in args)
    return [sys.executable, "-m", module, *args, *(["--config.tracking.report=False"] if no_report else [])]


def run_cli(args, devices: int = 8, cwd=ROOT, timeout: int = 300, module: str = "jaxscale.train",
            flags: str = FAST_COMPILE, env: dict | None = None):
    """Run `python -m MODULE ARGS` in a fresh process with `devices` fake CPU devices (and `env`
    over the environment)."""
    import subprocess

    return subprocess.run(_command(module, args), cwd=cwd, env={**cli_env(devices, flags), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


# Runs each command of a JSON list with MODULE's main(argv) in this one process, its stdout and
# stderr captured, and prints their [exit code, stdout, stderr] as one JSON list.
_MANY = """import contextlib, importlib, io, json, sys
module, commands, results = importlib.import_module(sys.argv[1]), json.loads(sys.argv[2]), []
for argv in commands:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_clis(commands: list[list[str]], module: str, env: dict | None = None):
    """`run_cli` for several commands of one module in one fresh process, one after another (one
    interpreter's start, imports and backend for all of them): a CompletedProcess for each."""
    import json
    import subprocess

    argv = json.dumps([_command(module, a)[3:] for a in commands])
    done = subprocess.run([sys.executable, "-c", _MANY, module, argv], cwd=ROOT, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return [subprocess.CompletedProcess(_command(module, a), code, out, done.stderr + err)
            for a, (code, out, err) in zip(commands, results)]


def main_cli(args, module: str = "jaxscale.train"):
    """`python -m MODULE ARGS` run in this process: its `main(argv)` with stdout and stderr
    captured, returned as a CompletedProcess. The same command as `run_cli` with 8 devices and
    FAST_COMPILE (this process's devices and flags), without a fresh interpreter importing the
    whole stack again (about 9 s of CPU a run); for runs that need no process of their own."""
    import importlib
    import io
    import subprocess

    command = _command(module, args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(module).main(command[3:])
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


def start_cli(args, devices: int = 8, module: str = "jaxscale.train", flags: str = FAST_COMPILE):
    """Start `python -m MODULE ARGS` without waiting (stdout and stderr piped together)."""
    import subprocess

    return subprocess.Popen(_command(module, args), cwd=ROOT, env=cli_env(devices, flags),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def fast_run_steps():
    """Steps built inside this block compile at FAST_RUN's optimisation level (XLA's per-compile
    options, jaxscale.runtime.xla_flags): for a test that runs tens of steps in this process, whose
    flags are FAST_COMPILE's (test_fp8's six 50-step runs: 32 against 24 s of CPU, measured)."""
    from jaxscale.runtime import xla_flags

    options = xla_flags.compiler_options

    def faster(xla_cfg, platform, *args, **kwargs):
        return options(xla_cfg, platform, *args, **kwargs) + ((("xla_backend_optimization_level", 1),)
                                                               if platform == "cpu" else ())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla_flags, "compiler_options", faster)
        yield


assert jax.device_count() == 8, "tests expect 8 fake CPU devices; was jax imported before conftest?"

