"""Plans for NVIDIA GPU hosts, compiled by XLA's GPU compiler on this CPU host (JAX's CUDA plugin
against a described target: jaxscale.analysis.gpu_targets), and GPU topology names."""

import json

import pytest

from conftest import ROOT, run_cli, run_clis
from jaxscale import cli
from jaxscale.analysis import mfu, topology
from jaxscale.analysis.hardware import GPUS
from jaxscale.errors import ConfigError
from sends import Sizes, assert_sends

# The datasheets: H100 SXM5, 80 GB HBM3 at 3.35 TB/s; H200, 141 GB HBM3e at 4.8 TB/s; both 989
# dense bf16 TFLOP/s. The driver reports a little less memory than that many GiB (H100: 79.1 GiB).
DATASHEET = {"h100": (80, 3.35e12, 989.0), "h200": (141, 4.8e12, 989.0)}


@pytest.mark.parametrize("name, gpus, shape", [("h100-8", 8, "1x1x8"), ("h100-2", 2, "1x1x2"),
                                               ("h200-16", 16, "1x2x8"), ("H100-64", 64, "1x8x8")])
def test_gpu_names(name, gpus, shape):
    pod = topology.parse(name)
    assert (pod.platform, pod.chips, pod.slices, pod.shape) == ("gpu", gpus, 1, shape)
    gib, bandwidth, peak = DATASHEET[pod.generation]
    gpu = GPUS[pod.generation]
    assert (gib - 1) * 2**30 < pod.hbm_per_chip <= gib * 2**30
    assert gpu.memory_bandwidth == pytest.approx(bandwidth, rel=0.01) and mfu.peak_tflops(gpu.name) == peak


@pytest.mark.parametrize("name, words", [("h100-12", "a multiple of 8"), ("a100-8", "GPUs such as h100-8")])
def test_a_bad_gpu_name_names_the_flag(name, words):
    with pytest.raises(ConfigError) as info:
        topology.parse(name)
    assert info.value.field == "--topology" and words in str(info.value)


# `make test` installs JAX's CUDA plugin here, outside the venv's site-packages (see the Makefile).
GPU_PLAN = ROOT / ".venv" / "gpu-plan"


def _plan_args(overrides, flags=("--json",), topology="h100-8") -> list[str]:
    return ["--config=configs/tiny.py", *(f"--config.{o}" for o in overrides), f"--topology={topology}", *flags]


ZERO2 = ["mesh.data=8", "zero_stage=2", "model.dtype='float32'"]
FSDP = ["mesh.data=1", "mesh.fsdp=8", "model.dtype='float32'"]
DETERMINISTIC = ["mesh.data=8", "train.deterministic=True", "model.dtype='bfloat16'"]
FP8 = ["mesh.data=1", "model.fp8=True", "model.dtype='bfloat16'"]


@pytest.fixture(scope="module")
def gpu_plans(tmp_path_factory):
    """Each plan below from the GPU compiler, all in one process (one start of JAX and its CUDA
    plugin: 10 s of CPU a process, measured), as `python -m jaxscale.plan` runs each command."""
    if not (GPU_PLAN / "jax_plugins" / "xla_cuda12").is_dir():
        pytest.skip(f"compiling for GPUs needs JAX's CUDA plugin in {GPU_PLAN} (make test installs it)")
    hlo = tmp_path_factory.mktemp("fp8") / "step.hlo"
    commands = {"zero2": _plan_args(ZERO2), "fsdp": _plan_args(FSDP), "deterministic": _plan_args(DETERMINISTIC),
                "cudnn": _plan_args(["train.deterministic=True", "model.dtype='bfloat16'",
                                     "model.attention.impl=cudnn"], flags=()),
                "fp8": _plan_args(FP8, ["--json", f"--hlo={hlo}"], "h100-1")}
    results = run_clis(list(commands.values()), module="jaxscale.plan", env={"PYTHONPATH": str(GPU_PLAN)})
    return dict(zip(commands, results)) | {"fp8_hlo": hlo}


def _plan(gpu_plans, name) -> dict:
    result = gpu_plans[name]
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_zero2_on_eight_h100s_reduce_scatters_its_gradients(gpu_plans):
    """The GPU compiler emits the reduce-scatter XLA:CPU cannot (measured: 0.875 W, the formula
    exactly), and the plan says whether it fits in an H100's memory."""
    plan = _plan(gpu_plans, "zero2")
    assert plan["platform"] == "gpu" and plan["topology"]["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert plan["memory_limit_bytes"] == GPUS["h100"].memory_bytes and plan["fits"] is True
    config = cli.load_config(str(ROOT / "configs" / "tiny.py"), ZERO2)
    spec = {("reduce-scatter", "data"): lambda s: 7 / 8 * s.w, ("all-gather", "data"): lambda s: 7 / 8 * s.w}
    assert_sends(plan, spec, Sizes.of(config, plan))


def test_fsdp_on_eight_h100s_gathers_weights_and_reduce_scatters_gradients(gpu_plans):
    """FSDP as the CPU spec has it (tests/test_plan.py, fsdp8), from the GPU compiler: weights
    all-gathered (the head's chunks twice), gradients reduce-scattered, the embedding's rows
    exchanged by all-to-all (measured: 0.94 W, 0.875 W and 1.75 A). Compiled with jaxscale's
    GPU flags, as a GPU run is, the schedule sends 0.48 of those bytes beside matmuls (0.24
    with XLA's own flags): too few FLOPs at this size to hide more than a sliver of them."""
    plan = _plan(gpu_plans, "fsdp")
    config = cli.load_config(str(ROOT / "configs" / "tiny.py"), FSDP)
    spec = {("all-gather", "fsdp"): lambda s: 7 / 8 * (s.w + s.t), ("reduce-scatter", "fsdp"): lambda s: 7 / 8 * s.w,
            ("all-to-all", "fsdp"): lambda s: 2 * 7 / 8 * s.a}
    assert_sends(plan, spec, Sizes.of(config, plan))
    row = plan["overlap"]["fsdp"]
    assert row["async_bytes"] > 0.4 * row["sent_bytes"] and row["flops_beside"] > 0
    assert 0 < row["hidden_bytes"] < row["exposed_bytes"]
    assert row["hidden_bytes"] + row["exposed_bytes"] == pytest.approx(row["sent_bytes"])


def test_without_the_cuda_plugin_the_error_says_what_to_install():
    result = run_cli(["--config=configs/tiny.py", "--topology=h100-8"], module="jaxscale.plan")
    assert result.returncode == 2 and "jaxscale[gpu-plan]" in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_gpu_compiler_takes_the_deterministic_step_and_cudnn_is_refused(gpu_plans):
    """train.deterministic on a GPU: the step compiles with XLA's deterministic ops and the
    blockwise attention (a note says why not cuDNN's); asking for cuDNN's is a one-line error."""
    plan = _plan(gpu_plans, "deterministic")
    assert any("not deterministic" in note for note in plan["notes"]), plan["notes"]
    result = gpu_plans["cudnn"]
    # (the CUDA plugin prints its driver lines on stderr first; the error is one line, the last)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("jaxscale: error: model.attention.impl"), result.stderr[-500:]


def test_fp8_projections_compile_to_fp8_matmuls_for_an_h100(gpu_plans):
    """model.fp8 on one H100: each layer projection's three matmuls (forward, dx, dw) take fp8
    operands, e4m3 and e5m2, in the GPU compiler's step (tiny.py: 7 projections, 2 layers)."""
    import re

    _plan(gpu_plans, "fp8")
    text = gpu_plans["fp8_hlo"].read_text()
    signatures = re.findall(r"^%\S+ \(([^)]*)\) -> ", text, re.M) + re.findall(r" dot\(([^)]*)\)", text)
    fp8_gemms = [s for s in signatures if "f8e4m3fn[" in s and ("f8e4m3fn[" in s.split(",", 1)[1] or "f8e5m2[" in s)]
    assert len(fp8_gemms) >= 3 * 7, len(fp8_gemms)
