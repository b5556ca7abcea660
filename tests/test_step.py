"""The jitted train step: device-count independence, accumulation, one reduction per step."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import build_for, initial_state
from jaxscale.config import defaults
from jaxscale.models import ModelSpec
from jaxscale.models.precision import compute_dtype

SPEC = ModelSpec(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, d_ff=128)


def _batch(rows=32, length=32, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _layout(devices=None, **settings):
    """A run's mesh sizes and sharding settings (devices, zero_stage, sequence_parallel, axes: see
    conftest.build_for)."""
    return dict(devices=devices, **settings)


def _run(layout, accum, optim_cfg, steps=2, rows=32, vary=True, dtype="float32", spec=SPEC, strategy=None):
    """(metrics per step, final params, step fn, state, last batch) of `steps` updates."""
    run = build_for(spec, optim=optim_cfg, accum=accum, rows=rows, dtype=dtype, **layout, **(strategy or {}))
    return _steps(run, (spec, optim_cfg.to_json()), steps, rows, vary)


def _steps(run, key, steps, rows=32, vary=True):
    """_run's result for the built `run`, from the initial state of `key` (see conftest.initial_state)."""
    state = initial_state(run, key)
    history = []
    for i in range(steps):
        batch = jax.device_put(_batch(rows, seed=i if vary else 0), run.batch_sharding)
        state, metrics = run.train_step(state, batch)
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params), run.train_step, state, batch


@pytest.fixture(scope="module")
def optim_cfg():
    from jaxscale.config import defaults
    return defaults().optim


@pytest.fixture(scope="module")
def reference(optim_cfg):
    return _run(_layout(1), 1, optim_cfg, steps=3)


def _assert_same(a, b, rtol, params=True):
    assert len(a[0]) == len(b[0])
    for ma, mb in zip(a[0], b[0]):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(ma[key], mb[key], rtol=rtol)
    # Adam divides by sqrt(v): parameters agree to a fraction of one update (lr = 3e-4).
    if params:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-5), a[1], b[1])


LAYOUTS = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "data2_fsdp4": dict(data=2, fsdp=4),
    "data2_tensor4": dict(data=2, tensor=4),
    "fsdp2_tensor4_sp": dict(fsdp=2, tensor=4, sequence_parallel=True),
    "data2_fsdp2_tensor2_zero1": dict(data=2, fsdp=2, tensor=2, zero_stage=1),
    "zero1_data8": dict(data=8, zero_stage=1),  # stages 2 and 3: test_accumulation_equals_one_big_batch
    # sequence=4 beside data=2, with accumulation: test_context_parallel_modes_with_accumulation
    "data2_sequence2_tensor2": dict(data=2, sequence=2, tensor=2),
    "fsdp2_sequence4_zero3": dict(data=1, fsdp=2, sequence=4, zero_stage=3),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_equals_one_device(reference, optim_cfg, name):
    """Loss and grad norm over 3 steps equal the 1-device run (fp32, 1e-5 relative)."""
    _assert_same(_run(_layout(**LAYOUTS[name]), 1, optim_cfg, steps=3), reference, rtol=1e-5)


# sharding.overlap=all under full remat, where a layer's gathers' transposes reduce its gradients
# over every batch axis: each layer's reduce-scatter moves into the backward pass of the layer
# before it (parallel.fsdp.scan_deferred), and the head's chunks are gathered a chunk ahead (all
# that `head` does). Where a data axis leaves a sum to the map's edge, the layers reduce their own.
DEFERRED = {"fsdp8": (dict(fsdp=8, overlap="all"), True),
            "zero3_data2_fsdp2_tensor2": (dict(data=2, fsdp=2, tensor=2, zero_stage=3, overlap="all"), True),
            "fsdp8_head": (dict(fsdp=8, overlap="head"), False),
            "data2_fsdp4": (dict(data=2, fsdp=4, overlap="all"), False)}


@pytest.mark.parametrize("name", DEFERRED)
def test_full_remat_reducing_each_layer_behind_equals_one_device(reference, optim_cfg, name, monkeypatch):
    from jaxscale.parallel import fsdp
    layout, deferred = DEFERRED[name]
    calls, real = [], fsdp.scan_deferred
    monkeypatch.setattr(fsdp, "scan_deferred", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = dataclasses.replace(SPEC, remat="full")
    _assert_same(_run(_layout(**layout), 1, optim_cfg, steps=3, spec=spec), reference, rtol=1e-5)
    assert bool(calls) == deferred


@pytest.mark.parametrize("name, sizes", [("fsdp2_tensor4", dict(fsdp=2)), ("data2_tensor4_gelu_bias", dict(data=2))])
def test_collective_matmuls_equal_one_device(reference, optim_cfg, name, sizes, monkeypatch):
    """sharding.collective_matmul: each dense layer's q/k/v and MLP input projections gather their
    input in ring steps (parallel.collective_matmul.gathered) and the output projections scatter
    theirs (scattered), two of each a layer; the steps equal one device's. With GPT-2's GELU MLP
    and biases too (a bias added once, after the sum)."""
    from jaxscale.parallel import collective_matmul
    calls = []
    for ring in ("gathered", "scattered"):
        real = getattr(collective_matmul, ring)
        monkeypatch.setattr(collective_matmul, ring, lambda *a, _n=ring, _f=real, **k: calls.append(_n) or _f(*a, **k))
    spec = SPEC if name == "fsdp2_tensor4" else dataclasses.replace(SPEC, family="gpt2")
    one = reference if spec == SPEC else _run(_layout(1), 1, optim_cfg, steps=3, spec=spec)
    calls.clear()
    split = _run(_layout(tensor=4, sequence_parallel=True, collective_matmul="on", **sizes), 1, optim_cfg, steps=3,
                 spec=spec)
    assert sorted(set(calls)) == ["gathered", "scattered"] and calls.count("gathered") == calls.count("scattered")
    _assert_same(split, one, rtol=1e-5)


# A vocabulary of 257 splits over no axis: tensor keeps it whole (rules_from_config says so), fsdp
# splits the table along d_model as always; tied and untied heads, each under a tensor layout
# and one that splits d_model.
ODD_VOCAB = {f"{head}_{name}": (ModelSpec(**{**SPEC.__dict__, "vocab_size": 257, "tie_embeddings": head == "tied"}),
                                {**LAYOUTS, "zero3_data8": dict(data=8, zero_stage=3)}[name])
             for head, names in (("tied", ("data2_tensor4", "zero3_data8")), ("untied", ("fsdp8", "fsdp2_tensor4_sp")))
             for name in names}


@pytest.fixture(scope="module")
def odd_references(optim_cfg):
    specs = {name.split("_")[0]: spec for name, (spec, _) in ODD_VOCAB.items()}
    return {head: _run(_layout(1), 1, optim_cfg, steps=2, spec=spec) for head, spec in specs.items()}


@pytest.mark.parametrize("name", ODD_VOCAB)
def test_a_vocabulary_that_divides_nothing_equals_one_device(optim_cfg, odd_references, name):
    spec, sizes = ODD_VOCAB[name]
    _assert_same(_run(_layout(**sizes), 1, optim_cfg, steps=2, spec=spec),
                 odd_references[name.split("_")[0]], rtol=1e-5)


DEEP = ModelSpec(**{**SPEC.__dict__, "num_layers": 4})
GPIPE = dict(microbatches=4)


@pytest.fixture(scope="module")
def deep_reference(optim_cfg):
    return _run(_layout(1), 1, optim_cfg, steps=3, spec=DEEP)


# (schedule, virtual stages, mesh): every schedule on 2 and 4 stages; 1f1b's and interleaved_1f1b's
# 2-stage tables beside data and tensor (gpipe's: test_gpipe_with_accumulation, beside data;
# zero_bubble's split backward on 2 stages: the schedule-file test below and tests/test_moe.py);
# with sequence > 1 the gpipe forward differentiated by autodiff (the executor refuses it)
SCHEDULES = {
    "circular_pipeline2": ("circular", 2, dict(pipeline=2)),
    "gpipe_pipeline4": ("gpipe", 1, dict(pipeline=4)),
    "1f1b_pipeline4": ("1f1b", 1, dict(pipeline=4)),
    "zero_bubble_pipeline4": ("zero_bubble", 1, dict(pipeline=4)),
    "1f1b_data2_pipeline2_tensor2": ("1f1b", 1, dict(data=2, pipeline=2, tensor=2)),
    "interleaved_1f1b_data2_pipeline2_tensor2": ("interleaved_1f1b", 2, dict(data=2, pipeline=2, tensor=2)),
    "gpipe_pipeline2_fsdp2_sequence2_zero1": ("gpipe", 1, dict(pipeline=2, fsdp=2, sequence=2, zero_stage=1)),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_equals_one_device(deep_reference, optim_cfg, name):
    """Loss, grad norm and parameters after 3 steps equal the unpipelined run (fp32, 1e-5): the
    schedule's executor (forward and backward by its table) computes the same gradients."""
    schedule, virtual, sizes = SCHEDULES[name]
    strategy = dict(schedule=schedule, microbatches=4, virtual_stages=virtual)
    _assert_same(_run(_layout(**sizes), 1, optim_cfg, steps=3, spec=DEEP, strategy=strategy),
                 deep_reference, rtol=1e-5)


# DEEP with the layer pattern LG: windows of 8 tokens of 32 on the L layers, scores soft-capped at 5.
PATTERNED = ModelSpec(**{**DEEP.__dict__, "layer_pattern": "LG", "sliding_window": 8, "attn_logit_softcap": 5.0})


@pytest.fixture(scope="module")
def patterned_reference(optim_cfg):
    return _run(_layout(1), 1, optim_cfg, steps=2, spec=PATTERNED)


def test_a_layer_pattern_in_pipeline_stages_equals_one_device(patterned_reference, optim_cfg):
    """Each of 2 stages holds a whole period of LG: 1F1B's executor runs each layer as its kind,
    as one device does."""
    strategy = dict(schedule="1f1b", microbatches=4)
    _assert_same(_run(_layout(pipeline=2), 1, optim_cfg, steps=2, spec=PATTERNED, strategy=strategy),
                 patterned_reference, rtol=1e-5)


def test_ulysses_takes_windows_and_soft_capped_scores_beside_tensor_parallelism(patterned_reference, optim_cfg):
    """LG windows and capped scores under sequence=2 x tensor=2 (each device's 4 heads split over
    sequence): the steps one device takes."""
    ulysses = _run(_layout(sequence=2, tensor=2), 1, optim_cfg, steps=2, spec=PATTERNED,
                   strategy=dict(context="ulysses"))
    _assert_same(ulysses, patterned_reference, rtol=1e-5)


DEEPER = ModelSpec(**{**SPEC.__dict__, "num_layers": 8})


@pytest.fixture(scope="module")
def deeper_reference(optim_cfg):
    return _run(_layout(1), 1, optim_cfg, steps=3, spec=DEEPER)


@pytest.mark.parametrize("schedule", ["circular", "interleaved_1f1b"])
def test_interleaved_schedules_on_four_stages_equal_one_device(deeper_reference, optim_cfg, schedule):
    """V=2 chunks on each of 4 stages (8 layers): the interleaved tables on P=4."""
    reference = deeper_reference
    strategy = dict(schedule=schedule, microbatches=4, virtual_stages=2)
    _assert_same(_run(_layout(pipeline=4), 1, optim_cfg, steps=3, spec=DEEPER, strategy=strategy),
                 reference, rtol=1e-5)


def test_a_schedule_from_a_file_equals_one_device(deep_reference, optim_cfg, tmp_path):
    """A user's table (1F1B with the weight gradients split off and put off) runs as the named ones."""
    path = tmp_path / "schedule.txt"
    path.write_text("stage 0: F0 F1 B0 F2 B1 F3 B2 B3 W0 W1 W2 W3\n"
                    "stage 1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3\n")
    strategy = dict(schedule="file", microbatches=4, schedule_file=str(path))
    _assert_same(_run(_layout(pipeline=2), 1, optim_cfg, steps=3, spec=DEEP, strategy=strategy),
                 deep_reference, rtol=1e-5)


def test_bfloat16_pipeline_compiles_on_cpu_and_matches(optim_cfg):
    """bf16 compute through GPipe: XLA:CPU's all-reduce promotion pass used to abort the process
    on this program; it now runs and gives the unpipelined bf16 loss and grad norm."""
    one = _run(_layout(1), 1, optim_cfg, steps=1, dtype="bfloat16", spec=DEEP)
    piped = _run(_layout(data=2, pipeline=2), 1, optim_cfg, steps=1, dtype="bfloat16", spec=DEEP,
                 strategy=GPIPE)
    _assert_same(piped, one, rtol=1e-2, params=False)




def test_gpipe_with_accumulation(deep_reference, optim_cfg):
    _assert_same(_run(_layout(data=2, pipeline=2), 2, optim_cfg, steps=3, spec=DEEP, strategy=GPIPE),
                 deep_reference, rtol=1e-5)


@pytest.mark.parametrize("mode", ["all_gather", "ring", "ulysses"])
def test_context_parallel_modes_with_accumulation(reference, optim_cfg, mode):
    _assert_same(_run(_layout(data=2, sequence=4), 2, optim_cfg, steps=3, strategy=dict(context=mode)), reference,
                 rtol=1e-5)


def test_kv_heads_fewer_than_tensor_are_replicated(optim_cfg):
    spec = ModelSpec(num_layers=2, d_model=64, num_heads=8, num_kv_heads=2, d_ff=128)
    one = _run(_layout(1), 1, optim_cfg, spec=spec)
    layout = build_for(spec, tensor=4).layout
    assert (layout.spec(("embed", "kv_heads", "head_dim")) == P()
            and layout.spec(("embed", "heads")) == P(None, "tensor"))
    _assert_same(_run(_layout(tensor=4), 1, optim_cfg, spec=spec), one, rtol=1e-5)


@pytest.mark.parametrize("devices, zero_stage", [(1, 0), (8, 0), (8, 2), (8, 3)])
def test_accumulation_equals_one_big_batch(reference, optim_cfg, devices, zero_stage):
    _assert_same(_run(_layout(devices, data=devices, zero_stage=zero_stage), 4, optim_cfg, steps=3),
                 reference, rtol=1e-5)


def test_accumulation_reduces_gradients_once_per_step(optim_cfg):
    *_, step, state, batch = _run(_layout(data=8), 4, optim_cfg, steps=1)
    hlo = step.lower(state, batch).compile().as_text()
    reductions = re.findall(r"all-reduce\(.*", hlo)
    assert reductions, "expected a gradient all-reduce"
    for line in reductions:
        # no reduction inside the microbatch loop: every one comes from the final pmean
        assert "shard_map" in line and "while/body" not in line, line


def test_loss_falls_and_lr_warms_up(optim_cfg):
    fast = optim_cfg.copy_and_resolve_references()
    fast.update(lr=1e-2, warmup_steps=5)
    history, *_ = _run(_layout(data=2), 1, fast, steps=12, rows=8, vary=False)  # memorise one batch
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert 0 < history[0]["lr"] < history[5]["lr"]
    assert int(history[0]["tokens"]) == 8 * 32


def test_bfloat16_compute_keeps_float32_master_weights(reference, optim_cfg):
    history, params, *_ = _run(_layout(data=8), 1, optim_cfg, dtype="bfloat16")
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))
    np.testing.assert_allclose(history[0]["loss"], reference[0][0]["loss"], rtol=1e-2)
    assert history[0]["loss"].dtype == np.float32


def test_compute_dtype():
    assert compute_dtype("auto", "cpu") == jnp.float32
    assert compute_dtype("auto", "gpu") == jnp.bfloat16
    assert compute_dtype("bfloat16", "cpu") == jnp.bfloat16


def test_remat_policies_trade_compiled_memory(optim_cfg):
    """Temp bytes from compiled.memory_analysis(): none > dots_saveable > full (measured 124.0,
    82.0 and 53.7 MB); dots_saveable keeps the attention kernel's output and residuals, so its
    backward pass runs no attention forward again (full's does, in every layer's recompute)."""
    temp, rerun = {}, {}
    for remat in ("none", "dots_saveable", "full"):
        spec = ModelSpec(num_layers=4, d_model=64, num_heads=4, num_kv_heads=4, d_ff=256, remat=remat)
        compiled, _ = build_for(spec, optim=optim_cfg, rows=8, seq_len=256, devices=1).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        rerun[remat] = len(re.findall(r'op_name="[^"]*rematted_computation[^"]*flash_attention', compiled.as_text()))
    assert temp["none"] > 1.3 * temp["dots_saveable"] and temp["dots_saveable"] > 1.3 * temp["full"], temp
    assert rerun["none"] == rerun["dots_saveable"] == 0 < rerun["full"], rerun


def test_a_deterministic_run_gives_the_same_bits_twice(optim_cfg):
    """train.deterministic on CPU: XLA:CPU's steps are deterministic as they are (no options);
    the compiled step run twice from the same initial state ends with the same bits."""
    from jaxscale import determinism

    config = defaults()
    config.train.deterministic = True
    assert determinism.compiler_options(config, "cpu") == ()
    assert dict(determinism.compiler_options(config, "gpu")) == {"xla_gpu_deterministic_ops": True}
    run = build_for(SPEC, optim=optim_cfg, data=8)
    first, second = (_steps(run, (SPEC, optim_cfg.to_json()), steps=3)[1] for _ in range(2))
    jax.tree.map(np.testing.assert_array_equal, first, second)
