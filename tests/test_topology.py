"""Plans for TPU pod slices, compiled by the TPU compiler on this CPU host (libtpu's compile-only
client): slice names, per-device state bytes against the arithmetic, and the command line."""

import json

import pytest

from conftest import ROOT, cli_env
from jaxscale import cli
from jaxscale import config as config_lib
from jaxscale import plan as plan_lib
from jaxscale.analysis import hlo_stats, topology
from jaxscale.errors import ConfigError
from sends import Sizes, assert_sends, param_groups, sent_by_axis, state_bytes, vocabulary_arrays

pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (pip install 'jaxscale[tpu]')")


@pytest.mark.parametrize("name, chips, slices, shape, hbm_gib", [
    ("v5p-256", 128, 1, "4x4x8", 95),      # v4 and v5p names count TensorCores, 2 per chip
    ("v4-128", 64, 1, "4x4x4", 32),
    ("v5e-256", 256, 1, "16x16", 16),     # v5e and v6e names count chips
    ("v6e-8", 8, 1, "2x4", 32),
    ("2xv5e-256", 256, 2, "16x16", 16),   # two slices, joined over DCN
])
def test_slice_names(name, chips, slices, shape, hbm_gib):
    pod = topology.parse(name)
    assert (pod.chips, pod.slices, pod.shape, pod.hbm_per_chip) == (chips, slices, shape, hbm_gib * 2**30)


@pytest.mark.parametrize("name, words", [("v5p-7", "no such v5p slice"), ("v3-8", "expected a Cloud TPU slice"),
                                         ("v5e-512", "v5e-256")])
def test_a_bad_slice_name_names_the_flag(name, words):
    with pytest.raises(ConfigError) as info:
        topology.parse(name)
    assert info.value.field == "--topology" and words in str(info.value)


def test_devices_come_from_libtpu_and_share_a_chips_hbm():
    devices, pod = topology.compile_only_devices("2xv5e-16")
    assert len(devices) == 32 and {d.slice_index for d in devices} == {0, 1}
    assert devices[0].device_kind == "TPU v5 lite" and topology.hbm_per_device(pod, devices) == 16 * 2**30


def test_an_axis_no_whole_torus_axes_make_splits_one():
    """expert=8 x fsdp=8 on a v5p-128 (4x4x4 chips): no product of whole torus axes is 8, so the
    mesh splits one (as JAX allows when asked) rather than failing; every chip once."""
    from jaxscale.mesh import AXES, make_mesh

    devices, _ = topology.compile_only_devices("v5p-128")
    mesh = make_mesh({**dict.fromkeys(AXES, 1), "expert": 8, "fsdp": 8}, devices)
    assert (mesh.shape["expert"], mesh.shape["fsdp"]) == (8, 8)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_without_libtpu_the_error_says_what_to_install(monkeypatch):
    from jax.experimental import topologies

    def absent(*args, **kwargs):
        raise RuntimeError("Unable to initialize backend 'tpu': no libtpu")

    monkeypatch.setattr(topologies, "get_topology_desc", absent)
    with pytest.raises(ConfigError, match=r"jaxscale\[tpu\]") as info:
        topology.compile_only_devices("v5e-8")
    assert info.value.field == "--topology"


def _config(*overrides):
    config = config_lib.load(str(ROOT / "configs" / "tiny.py"))
    config_lib.apply_overrides(config, ["mesh.data=1", "train.global_batch_size=256", "model.d_model=256",
                                        "model.d_ff=512", *overrides])
    return config


# FSDP's share on a pod is pod_fsdp32's below (and the Llama-3-8B slice's).
POD_LAYOUTS = {"zero1_data64": ["mesh.data=64", "zero_stage=1"], "zero3_data64": ["mesh.data=64", "zero_stage=3"]}


@pytest.fixture(scope="module")
def pod_plans():
    """A small model (tiny.py at d_model 256) compiled for 64 v5e chips: data with ZeRO-1 and
    ZeRO-3. (At 256 chips each compile took 15.1 s of CPU against 6.0 s
    here; the 128-chip slice is configs/llama3_8b.py's below.)"""
    devices, _ = topology.compile_only_devices("v5e-64")
    return {name: plan_lib.make_plan(_config(*o), "tpu", devices) for name, o in POD_LAYOUTS.items()}


# The collectives spec (test_plan.COLLECTIVES_SPEC, whose sizes it uses) as the TPU compiler meets
# it, in float32 on 8 v5e chips. Where XLA:CPU falls short (see there), the TPU compiler emits
# the reduce-scatter, sums the q, k, v (and gate, up) input gradients before reducing them (4
# tensor collectives of A a layer, as Megatron), and sums the tied embedding's two gradient terms
# before reducing them (no T). With sequence parallelism it gathers in bfloat16 the activations its
# default-precision matmuls read (9 of the 10): 0.55 of the formula's float32 all-gather bytes.
# One of those gathers runs as a continuation chain (start, three steps, done), counted once.
# With collective matmuls (sharding.collective_matmul, on for the TPU compiler by default) each
# layer's four gathers and four reduce-scatters over tensor are rings of 3 permutes of a quarter of A
# each, half of them (the forward's gathers and their transposes) in bfloat16 as above; the lookup's
# and the head's stay as they were.
# Not yet in the spec, measured here: fsdp=8 gathers 2.46 W of parameters per step (2 W expected:
# forward and backward) and ZeRO-3 over data=8 gathers 4.30 W.
L4 = 4 * 2 + 2
TPU_COLLECTIVES_SPEC = {
    "data8": {("all-reduce", "data"): lambda s: 2 * 7 / 8 * s.w},
    "zero2_accum4": {("reduce-scatter", "data"): lambda s: 4 * 7 / 8 * s.w,  # per microbatch
                     ("all-gather", "data"): lambda s: 7 / 8 * s.w},
    "tensor4": {("all-reduce", "tensor"): lambda s: 2 * 3 / 4 * L4 * s.a,
                ("all-reduce", "data"): lambda s: 2 * 1 / 2 * s.w / 4},
    "tensor4_sp": {("all-gather", "tensor"): lambda s: 0.55 * 3 / 4 * L4 * s.a,
                   ("reduce-scatter", "tensor"): lambda s: 3 / 4 * L4 * s.a,
                   ("all-reduce", "data"): lambda s: 2 * 1 / 2 * s.w / 4},
    "tensor4_collective": {("collective-permute", "tensor"): lambda s: 3 / 4 * (4 + 4 / 2) * s.layers * s.a,
                           ("all-gather", "tensor"): lambda s: 3 / 4 * 1.5 * s.a,
                           ("reduce-scatter", "tensor"): lambda s: 3 / 4 * 2 * s.a,
                           ("all-reduce", "data"): lambda s: 2 * 1 / 2 * s.w / 4},
    "pipeline2_gpipe": {("collective-permute", "pipeline"): lambda s: 2 * (2 * 4 + 2) * s.a / 4,
                        ("all-reduce", "data+pipeline"): lambda s: 2 * 7 / 8 * (s.w - s.layers * s.layer),
                        ("all-reduce", "data"): lambda s: 2 * 3 / 4 * s.layers * s.layer / 2},
}
TENSOR4 = ["mesh.data=2", "mesh.tensor=4", "model.num_kv_heads=4"]
TPU_LAYOUTS = {"data8": ["mesh.data=8"],
               "zero2_accum4": ["mesh.data=8", "zero_stage=2", "train.global_batch_size=32",
                                "train.grad_accum_steps=4"],
               "tensor4": [*TENSOR4, "sharding.sequence_parallel=False"],
               "tensor4_sp": [*TENSOR4, "sharding.collective_matmul=off"], "tensor4_collective": TENSOR4,
               "pipeline2_gpipe": ["mesh.data=4", "mesh.pipeline=2", "model.num_layers=4", "pipeline.schedule=gpipe",
                                   "pipeline.microbatches=4", "train.global_batch_size=16"]}


def _tpu_config(name):
    return cli.load_config(str(ROOT / "configs" / "tiny.py"), ["mesh.data=1", "model.dtype='float32'",
                                                                 *TPU_LAYOUTS[name]])


@pytest.fixture(scope="module")
def v5e8_plans():
    devices, _ = topology.compile_only_devices("v5e-8")
    return {name: plan_lib.plan_for(_tpu_config(name), "tpu", devices) for name in TPU_LAYOUTS}


@pytest.mark.parametrize("name", list(TPU_COLLECTIVES_SPEC))
def test_the_tpu_compiler_sends_what_the_spec_says(v5e8_plans, name):
    plan = v5e8_plans[name].to_json()  # as --json prints it
    assert_sends(plan, TPU_COLLECTIVES_SPEC[name], Sizes.of(_tpu_config(name), plan))


def test_a_tpu_plan_does_not_report_matmul_flops_it_cannot_read(v5e8_plans):
    # The TPU compiler writes matmuls as convolutions: the compiled count stays unknown, not 0.
    flops = v5e8_plans["data8"].flops
    assert flops.compiled_per_device is None and flops.ratio is None and flops.formula_per_device > 0
    assert "not read" in plan_lib.table(v5e8_plans["data8"])


def _assert_state_matches_config(plan: dict, config, devices: int, rel: float) -> None:
    """The state each chip holds, as the TPU compiler placed it, against the arithmetic from the
    config alone (tests/sends.state_bytes: its mesh, ZeRO stage and model, never the planner's
    layout), and the planner's own arithmetic column against the same."""
    assert plan["num_params"] == sum(param_groups(config).values())
    got, want = plan["per_device_bytes"], state_bytes(config, devices)
    for key in ("params", "grads", "opt_state"):
        assert got[key] == pytest.approx(want[key], rel=rel), key
        assert plan["expected_bytes"][key] == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.parametrize("name", list(POD_LAYOUTS))
def test_state_bytes_from_the_tpu_compiler_match_the_arithmetic(pod_plans, name):
    plan = pod_plans[name]
    _assert_state_matches_config(plan, _config(*POD_LAYOUTS[name]), 64, rel=0.05)
    assert plan["compiled_bytes"]["code"] > 0  # the TPU executable's own size is reported


def test_llama3_8b_on_v5p_256_holds_the_state_the_arithmetic_says():
    """configs/llama3_8b.py (8.0B parameters) on 128 v5p chips as data=8 x fsdp=16 with ZeRO-2:
    parameters split 16 ways, gradients and Adam state 128 ways, per chip as the TPU compiler
    placed them (measured: the arithmetic exactly, 1.87, 0.234 and 0.467 GiB). At a small batch
    of short rows (the state does not depend on them): 21 s of CPU at 128 x 64 against 31 s at
    128 x 256 and 3 min at the config's 256 x 8192, measured."""
    devices, _ = topology.compile_only_devices("v5p-256")
    config = cli.load_config(str(ROOT / "configs" / "llama3_8b.py"),
                             ["mesh.data=8", "mesh.fsdp=16", "zero_stage=2", "train.global_batch_size=128",
                              "train.seq_len=64"])
    plan = plan_lib.make_plan(config, "tpu", devices)
    assert plan["num_params"] == pytest.approx(8.03e9, rel=1e-3)  # Llama 3 8B's published count
    _assert_state_matches_config(plan, config, 128, rel=0.05)
    assert plan["per_device_bytes"]["total"] < 95 * 2**30  # fits a v5p chip's HBM


# The command turns JAX's persistent cache off before it compiles (the compile-only client cannot
# load what it would store); in this process the cache was already on, so a second compile of the
# same step reads an entry back and JAX warns.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_cli_says_whether_it_fits(capsys):
    args = ["--config=configs/tiny.py", "--config.mesh.data=-1", "--topology=v5e-8", "--json"]
    assert plan_lib.main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["topology"] == {"name": "v5e-8", "slices": 1, "chips_per_slice": 8, "devices": 8,
                                "device_kind": "TPU v5 lite"}
    assert plan["memory_limit_bytes"] == 16 * 2**30 and plan["fits"] is True and plan["warnings"] == []
    assert plan["collectives"]["all-reduce"]["count"] > 0  # data parallel: the gradients are summed
    # Priced on the target's rates: what the compute beside each collective hides, and the rest.
    row = plan["overlap"]["data"]
    assert row["hidden_bytes"] + row["exposed_bytes"] == pytest.approx(row["sent_bytes"]) and row["sent_bytes"] > 0
    assert plan["predicted"]["step_s"] >= plan["predicted"]["compute_s"] + plan["predicted"]["exposed_s"] > 0
    small = plan_lib.main([*args[:-1], "--device_memory_gb=0.001"])  # 1 MB: the state alone is 4.9 MB
    out = capsys.readouterr()
    assert small == 0 and "does not fit" in out.err
    assert "overlap (the compiled schedule" in out.out and "MiB exposed" in out.out
    assert "predicted step on v5e-8" in out.out


HOLD_A_CLIENT = ("import sys; from jaxscale.analysis import topology; topology.compile_only_devices('v5e-8'); "
                 "print('ready', flush=True); sys.stdin.readline()")


def test_two_tpu_plans_run_at_once():
    """A compile-only client owns no chip, so it takes no lock on the host's TPUs: a second one
    starts while the first holds libtpu (before, it died on libtpu's multi-process lockfile)."""
    import subprocess
    import sys

    env = {k: v for k, v in cli_env().items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    command = [sys.executable, "-c", HOLD_A_CLIENT]
    with subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as first:
        try:
            assert first.stdout.readline().strip() == "ready"  # it holds its client now
            second = subprocess.run(command, cwd=ROOT, env=env, input="\n", capture_output=True, text=True,
                                    timeout=300)
        finally:
            first.stdin.close()
    assert second.returncode == 0 and second.stdout.strip() == "ready", second.stderr[-2000:]


def test_cli_refuses_a_topology_for_another_platform(capsys):
    assert plan_lib.main(["--config=configs/tiny.py", "--topology=v5e-8", "--platform=gpu"]) == 2
    assert capsys.readouterr().err.startswith("jaxscale: error: --platform")


def test_on_tpu_attention_is_the_splash_kernel_on_each_chips_rows_and_heads():
    """`auto` takes JAX's Pallas splash kernel on TPU, packed documents included. Under data x
    tensor it runs in shard_map on each chip's rows and heads: its forward, dQ and dK/dV kernels
    are in the compiled step, and the step's collectives are exactly those of the blockwise
    kernel (nothing gathered or reduced for the kernel's sake). Without sequence parallelism: with
    it (the default) the splash step gathers less than the blockwise one (36 against 67
    all-gathers, 10.6 against 11.3 MB, measured)."""
    devices, _ = topology.compile_only_devices("v5e-8")
    compiled = {}
    for impl in ("auto", "xla"):
        config = config_lib.load(str(ROOT / "configs" / "tiny.py"))
        config_lib.apply_overrides(config, ["train.seq_len=1024", "train.global_batch_size=8", "mesh.data=4",
                                            "mesh.tensor=2", "data.document_mask=True", f"model.attention.impl={impl}",
                                            "sharding.sequence_parallel=False"])
        run, compiled[impl], _ = plan_lib.compile_plan(config, "tpu", devices)
        assert run.model.spec.attention_impl == ("splash" if impl == "auto" else "xla")
    hlo = compiled["auto"].as_text()
    assert all(f"%splash_mha_{kernel}" in hlo for kernel in ("fwd_segmented_residuals", "dq_segmented_no_residuals",
                                                          "dkv_segmented_no_residuals"))
    splash_totals, xla_totals = (hlo_stats.step_totals(compiled[i].as_text()) for i in ("auto", "xla"))
    assert splash_totals.unknown_loops == 0 and splash_totals.collectives == xla_totals.collectives


# The collectives spec for pods, its numbers from the config and the parameter count alone: a
# Llama-3 shape (configs/llama3_8b.py at 4 layers and d_model 1024, untied head) on 32 v5p chips,
# fsdp over all of them, full remat, bfloat16 compute, 4 chunks of the head a pass. (At d_model 512
# the TPU compiler wrote the attention weights' small gradient reduce-scatters, 128 KiB a stage, as
# all-reduces; at 1024 it compiles in 21 s of CPU against 48 s at 2048, measured.)
POD = ["mesh.data=1", "mesh.fsdp=-1", "model.num_layers=4", "model.d_model=1024", "model.num_heads=8",
       "model.num_kv_heads=4", "model.d_ff=2816", "model.vocab_size=16384", "train.seq_len=512",
       "train.global_batch_size=32", "model.head_chunk_mib=8"]


@pytest.fixture(scope="module")
def pod_fsdp32():
    devices, _ = topology.compile_only_devices("v5p-64")
    config = cli.load_config(str(ROOT / "configs" / "llama3_8b.py"), POD)
    run, compiled, seconds = plan_lib.compile_plan(config, "tpu", devices)
    return config, plan_lib.describe(config, run, compiled, seconds).to_json(), compiled.as_text()


def test_a_pod_gathers_weights_reduce_scatters_gradients_and_exchanges_rows(pod_fsdp32):
    """Per chip and step, by ring arithmetic (n = 32): every weight but the norm scales, in
    bfloat16, all-gathered twice (forward, and again in the rematerialised backward) and its
    gradient reduce-scattered once; the embedding's rows exchanged by all-to-all, forward and
    backward. Nothing else but the norm scales' gradients and scalars (under 2% of W)."""
    config, plan, _ = pod_fsdp32
    n, m = 32, config.model
    groups = param_groups(config)
    gathered = 2 * (groups["layers"] + groups["other"] - m.vocab_size * m.d_model)  # bf16: the head, not the table
    rows = 2 * config.train.global_batch_size // n * config.train.seq_len * m.d_model  # bf16 [rows, L, D]
    spec = {("all-gather", "fsdp"): lambda s: 2 * (n - 1) / n * gathered,
            ("reduce-scatter", "fsdp"): lambda s: (n - 1) / n * gathered,
            ("all-to-all", "fsdp"): lambda s: 2 * (n - 1) / n * rows}
    assert_sends(plan, spec, Sizes.of(config, plan))


def test_a_pod_holds_its_share_of_the_state_and_no_whole_table_or_logits(pod_fsdp32):
    config, plan, hlo = pod_fsdp32
    got, want = plan["per_device_bytes"], state_bytes(config, 32)
    for key in ("params", "opt_state"):
        assert got[key] == pytest.approx(want[key], rel=0.01), key
    assert max(vocabulary_arrays(hlo, 16384)) <= 1024 // 32  # at most each chip's own slice of the table, [V, D/32]


def _sent(plan: dict, kind: str) -> tuple[float, float]:
    """(bytes the collectives of `kind` over fsdp send a step, the part sent beside matmuls)."""
    rows = [w for w in plan["windows"] if w["kind"] == kind and w["axes"] == "fsdp"]
    return (sum(w["sent_bytes"] * w["runs"] for w in rows),
            sum(w["sent_bytes"] * w["runs"] for w in rows if w["flops_beside"] > 0))


def test_by_default_a_pods_gathers_and_reduce_scatters_run_beside_the_layers_matmuls(pod_fsdp32):
    """With the TPU defaults (xla.tpu_defaults, on by default) the weights' all-gathers and the
    gradients' reduce-scatters run on v5p's SparseCores beside the TensorCores' compute, and
    sharding.overlap=auto gathers the head's chunks a chunk ahead on the TPU compiler: read from
    the schedule, 0.67 of the gathered and 0.65 of the reduce-scattered bytes are sent beside
    matmuls (libtpu 0.0.42.1; the compiler's choice, the same on any host). With
    sharding.overlap=off it is 0.54 and 0.42: the head's gathers then wait for their chunk.
    Continuation fusions are for v5e only (libtpu 0.0.52 refuses them on v5p; docs/planning.md).
    A chain's collective is counted once, not once per step: the bytes are the ring arithmetic's
    (test_a_pod_gathers_weights...)."""
    config, plan, hlo = pod_fsdp32
    (gathered, gathered_beside), (scattered, scattered_beside) = (_sent(plan, k) for k in ("all-gather",
                                                                                          "reduce-scatter"))
    assert gathered_beside > 0.6 * gathered and scattered_beside > 0.6 * scattered
    assert 'async_execution_thread="sparsecore"' in hlo and "async-collective-start" not in hlo
    row = plan["overlap"]["fsdp"]
    assert row["async_bytes"] >= gathered_beside + scattered_beside and row["flops_beside"] > 0


def test_overlap_all_reduces_each_layer_beside_the_previous_layers_backward():
    """sharding.overlap=all: each layer's MLP gradients reduce-scattered during the previous
    layer's backward pass (its attention's in its own), the head's chunks gathered a chunk ahead
    and reduced a chunk behind. The same bytes by the ring arithmetic (and one chunk of the head
    gathered again), and more of them beside matmuls: read from the schedule, 0.75 of the
    reduce-scattered bytes against 0.65 by default (above; libtpu 0.0.42.1, v5p), and the
    gathers' 0.67 as by default."""
    devices, _ = topology.compile_only_devices("v5p-64")
    config = cli.load_config(str(ROOT / "configs" / "llama3_8b.py"), [*POD, "sharding.overlap=all"])
    run, compiled, seconds = plan_lib.compile_plan(config, "tpu", devices)
    plan = plan_lib.describe(config, run, compiled, seconds).to_json()
    (gathered, gathered_beside), (scattered, scattered_beside) = (_sent(plan, k) for k in ("all-gather",
                                                                                          "reduce-scatter"))
    assert gathered_beside > 0.6 * gathered and scattered_beside > 0.7 * scattered
    n, groups = 32, param_groups(config)
    layers = 2 * groups["layers"]  # bf16, reduce-scattered once
    assert plan["collectives_by_axis"]["reduce-scatter"]["fsdp"]["sent_bytes"] >= (n - 1) / n * layers


def test_gradients_are_reduced_in_float32_when_asked():
    """optim.grad_reduce_dtype=float32: the weights are still gathered in the compute dtype
    (bfloat16 on TPU), and their gradients reduce-scattered in float32, twice the bytes."""
    devices, _ = topology.compile_only_devices("v5e-8")
    sent = {}
    for dtype in ("", "float32"):
        config = _tpu_config("data8")
        config_lib.apply_overrides(config, ["mesh.data=1", "mesh.fsdp=8", "model.dtype='bfloat16'",
                                            f"optim.grad_reduce_dtype='{dtype}'"])
        sent[dtype] = sent_by_axis(plan_lib.make_plan(config, "tpu", devices))
    assert sent["float32"][("all-gather", "fsdp")] == pytest.approx(sent[""][("all-gather", "fsdp")], rel=0.01)
    assert sent["float32"][("reduce-scatter", "fsdp")] == pytest.approx(2 * sent[""][("reduce-scatter", "fsdp")],
                                                                        rel=0.01)
