"""The planner: compiled memory per device against the arithmetic, and collectives per step."""

import json
import math
import re

import pytest

from conftest import ROOT, main_cli, run_cli
from jaxscale import config as config_lib
from jaxscale.analysis import mfu
from jaxscale.analysis.plan_types import Plan
from jaxscale.models import model_from_config
from jaxscale.plan import advice, compile_plan, describe, make_plan, table
from sends import Sizes, assert_sends, param_groups, state_bytes, vocabulary_arrays

BATCH_BYTES = 2 * 32 * 128 * 4  # inputs + targets, int32, tiny config at batch 32 (a whole copy at most)
ACCUM4 = ["train.global_batch_size=32", "train.grad_accum_steps=4"]


def _config(*overrides, file="tiny.py"):
    config = config_lib.load(str(ROOT / "configs" / file))
    config_lib.apply_overrides(config, list(overrides))
    return config


def _plan(*overrides):
    return make_plan(_config("mesh.data=1", *overrides))


TENSOR4 = ["mesh.data=2", "mesh.tensor=4", "model.num_kv_heads=4"]  # 4 KV heads: the heads split evenly
SEQUENCE4 = ["mesh.data=2", "mesh.sequence=4"]
PIPELINE2 = ["mesh.data=4", "mesh.pipeline=2", "model.num_layers=4", "pipeline.schedule=gpipe",
             "pipeline.microbatches=4", "train.global_batch_size=16"]
LAYOUTS = {  # name -> (config file, overrides); tiny.py computes in float32 on CPU
    "data8": ["mesh.data=8"], "fsdp8": ["mesh.fsdp=8"], "zero1": ["mesh.data=8", "zero_stage=1"],
    "zero3": ["mesh.data=8", "zero_stage=3"],
    # Accumulating 4 microbatches (global batch 32: 4 rows per device each)
    "zero1_accum4": ["mesh.data=8", "zero_stage=1", *ACCUM4],
    "zero2_accum4": ["mesh.data=8", "zero_stage=2", *ACCUM4],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4"],
    "mixed": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "zero_stage=1"],
    "pipeline2_fsdp2": ["mesh.data=2", "mesh.pipeline=2", "mesh.fsdp=2", "model.num_layers=4"],
    "tensor4": [*TENSOR4, "sharding.sequence_parallel=False"], "tensor4_sp": TENSOR4,
    "sequence4_ring": SEQUENCE4, "sequence4_all_gather": [*SEQUENCE4, "model.attention.context_parallel='all_gather'"],
    "sequence4_ulysses": [*SEQUENCE4, "model.attention.context_parallel='ulysses'"],
    "pipeline2_gpipe": PIPELINE2,
    "pipeline2_circular": [*PIPELINE2, "pipeline.schedule=circular", "pipeline.virtual_stages=2"],
    "expert4": ("tiny_moe.py", ["mesh.data=2", "mesh.expert=4"]),
}


def _layout_config(name):
    file, overrides = LAYOUTS[name] if isinstance(LAYOUTS[name], tuple) else ("tiny.py", LAYOUTS[name])
    return _config("mesh.data=1", *overrides, file=file)


@pytest.fixture(scope="module")
def compiled():
    """Each layout's config, run and compiled train step."""
    return {name: (_layout_config(name), *compile_plan(_layout_config(name), "cpu")) for name in LAYOUTS}


@pytest.fixture(scope="module")
def plans(compiled):
    return {name: describe(*compiled[name]) for name in LAYOUTS}


def test_fsdp_splits_params_and_zero1_splits_only_optimizer_state(plans):
    dp, fsdp, zero1 = (plans[k].per_device_bytes for k in ("data8", "fsdp8", "zero1"))
    assert fsdp.params == pytest.approx(dp.params / 8, rel=0.05)
    assert fsdp.opt_state == pytest.approx(dp.opt_state / 8, rel=0.05)
    assert zero1.opt_state == pytest.approx(dp.opt_state / 8, rel=0.05)
    assert zero1.params == dp.params


def _assert_state_matches_config(plan: Plan, config) -> None:
    """The state each device holds, as the compiled step's shardings place it, against the
    arithmetic from the config alone (its mesh, ZeRO stage and model), never from the layout the
    planner built: a layout that split less than the config asks (a ZeRO stage dropped on the
    way) fails here, as does the planner's own arithmetic column if it drifts."""
    assert sum(param_groups(config).values()) == plan.num_params
    got, want = plan.per_device_bytes, state_bytes(config, 8)
    for key in ("params", "grads", "opt_state"):
        assert getattr(got, key) == pytest.approx(want[key], rel=0.01), key
        assert getattr(plan.expected_bytes, key) == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.parametrize("name", ["data8", "fsdp8", "zero1", "zero2_accum4", "zero3", "data2_fsdp4", "mixed",
                                  "pipeline2_fsdp2"])
def test_compiled_state_bytes_match_the_arithmetic(plans, name):
    """The state against the config's arithmetic; the step's other arguments are one batch, the
    step and the rng (nothing of the state counted twice or left out of its rows), and the
    gradients are among its temporaries."""
    plan = plans[name]
    _assert_state_matches_config(plan, _layout_config(name))
    got = plan.per_device_bytes
    assert 0 <= got.other_args <= BATCH_BYTES + 1024 and got.grads <= got.temp


@pytest.mark.parametrize("name, wrong", [("zero3", {"zero_stage": 0}), ("zero2_accum4", {"zero_stage": 1})],
                         ids=["zero3_as_0", "zero2_accum4_as_1"])
def test_a_layout_that_splits_less_than_the_config_asks_fails_the_byte_check(monkeypatch, name, wrong):
    """The check above catches the fault it is there for: the same config compiled with a layout
    whose ZeRO stage was dropped on the way (jaxscale.build's layout_from_config patched) holds
    whole what the config splits, and `_assert_state_matches_config` raises. (ZeRO-3 dropped to
    0 compiles data8's program, ZeRO-2 dropped to 1 zero1_accum4's: the persistent cache has
    them when the module runs whole.)"""
    import dataclasses

    from jaxscale import build

    real = build.layout_from_config

    def dropped(config, devices=None):
        layout, notes = real(config, devices)
        return dataclasses.replace(layout, **wrong), notes

    monkeypatch.setattr(build, "layout_from_config", dropped)
    config = _layout_config(name)
    plan = describe(config, *compile_plan(config, "cpu"))
    assert plan.zero_stage == wrong["zero_stage"]  # the fault was planted
    with pytest.raises(AssertionError, match=r"^(params|grads|opt_state)\b"):  # a state row, not the count
        _assert_state_matches_config(plan, config)


def test_zero2_accumulates_into_its_split_of_the_gradients(plans):
    """ZeRO-2 under accumulation: each microbatch's gradients are reduced into a running sum split
    over `data`, so no device holds a whole second copy, as ZeRO-1 does (its sum is whole until
    the step's one all-reduce). Measured: temp 8.00 MiB against ZeRO-1's 10.59 MiB, gradients 1.63 MiB."""
    zero1, zero2 = plans["zero1_accum4"], plans["zero2_accum4"]
    whole = zero1.per_device_bytes.grads  # ZeRO-1 keeps gradients whole
    assert zero2.per_device_bytes.grads == pytest.approx(whole / 8, rel=0.05)
    assert zero2.per_device_bytes.temp <= zero1.per_device_bytes.temp - (1 - 1 / 8) * whole
    # The reduction runs per microbatch inside the accumulation loop: 4 of them, each of the
    # whole gradient (XLA:CPU writes reduce-scatter as all-reduce + slice), against ZeRO-1's one.
    assert zero1.collectives["all-reduce"].bytes == pytest.approx(whole, rel=0.01)
    assert zero2.collectives["all-reduce"].bytes >= 4 * whole


@pytest.mark.parametrize("name", ["data8", "fsdp8", "mixed"])
def test_compiled_matmul_flops_match_the_formula(plans, name):
    # Every device does its share of the matmuls and no more; the pipeline plan does more per
    # device, its bubble ticks included. Beyond the formula, the blockwise attention recomputes its
    # scores in the backward (measured 1.021 of the formula on tiny.py, 1 + 0.021 recomputed), and
    # a head split along d_model (fsdp) runs in chunks whose logits the backward recomputes.
    config = _layout_config(name)
    recompute = mfu.attention_recompute_flops_per_token(model_from_config(config, "cpu")[0].spec,
                                                            config.train.seq_len)
    if config.mesh.fsdp > 1:
        recompute += 2 * config.model.d_model * config.model.vocab_size
    formula = plans[name].flops.formula_per_device
    per_device = config.train.global_batch_size * config.train.seq_len / math.prod(plans[name].mesh.values())
    assert plans[name].flops.ratio == pytest.approx(1.0 + recompute * per_device / formula, abs=0.005)


def test_zero_stages_move_collectives(plans):
    dp, fsdp = plans["data8"].collectives, plans["fsdp8"].collectives
    gradient_bytes = 4 * plans["data8"].num_params  # fp32 gradients of every parameter
    # data parallel: the whole gradient all-reduced once, no gathers. The tied embedding's two
    # gradient terms (the lookup's and the output head's) are reduced separately before they
    # are summed: one more vocab x d_model (256 x 128 on tiny), and a few scalars.
    tied = 4 * 256 * 128
    assert dp["all-reduce"].bytes == pytest.approx(gradient_bytes + tied, rel=1e-3)
    assert dp["all-gather"].count == 0
    assert fsdp["all-gather"].bytes >= 0.95 * gradient_bytes  # every parameter gathered whole before use
    assert plans["zero3"].collectives["all-gather"].bytes >= 0.95 * gradient_bytes


# What each layout sends per step: the collectives spec. tiny.py (tiny_moe.py for experts) in
# float32 on 8 CPU devices, in the sizes of `sends.Sizes` (s.w: every parameter, W; s.t: the tied
# embedding table, T; s.a: one device's [rows, length, d_model] activations, A; s.kv: its keys or
# values, K; s.dispatch: its tokens routed to the experts, X). Each row: (collective, the mesh axes
# it runs over) -> bytes each device sends per step, by ring arithmetic: all-reduce 2(n-1)/n S,
# all-gather and reduce-scatter (n-1)/n S of the whole S, all-to-all (n-1)/n of its buffer, a
# permute what it passes on. A layout's compiled step sends exactly these rows (rows under 2% of W,
# such as norm scales, scalars and token ids, may be left out, over these axes only), each within 10%.
# FSDP and ZeRO-3 are written out (parallel.fsdp, models.vocab): each layer's weights all-gathered
# where it runs (tiny.py keeps them for the backward, model.remat=none; with remat they are gathered
# again there), their gradients reduce-scattered (even on XLA:CPU, which partitions no
# reduce-scatter of its own), the embedding looked up where it is stored (its rows exchanged by
# all-to-all, forward and backward) and the head gathered chunk by chunk, forward and backward (+T).
# Forms XLA:CPU gets where another compiler does better (README, "What each layout sends"):
# - data parallel: no reduce-scatter of its own: ZeRO-2 reduces the whole gradient with an
#   all-reduce and keeps its slice (twice the bytes, "RS as AR");
# - tensor: it reduces the q, k, v (and gate, up) input gradients one by one, not their sum:
#   7 all-reduces of A a layer where Megatron has 4 (2 forward, 2 backward);
# - the tied table's two gradient terms (the lookup's, the head's) are summed over `data` apart (+T).
L4 = 4 * 2 + 2   # tensor collectives of A, tiny.py's 2 layers: 4 a layer, the lookup's and the head's
L7 = 7 * 2 + 2   # the same on XLA:CPU (see above)
COLLECTIVES_SPEC = {
    "data8": {("all-reduce", "data"): lambda s: 2 * 7 / 8 * (s.w + s.t)},         # the gradient, once
    "zero1": {("all-reduce", "data"): lambda s: 2 * 7 / 8 * (s.w + s.t),          # the gradient, once
              ("all-gather", "data"): lambda s: 7 / 8 * s.w},                     # the updated parameters
    "zero2_accum4": {("all-reduce", "data"): lambda s: 4 * 2 * 7 / 8 * (s.w + s.t),  # RS as AR, per microbatch
                     ("all-gather", "data"): lambda s: 7 / 8 * s.w},
    # ZeRO-3 is FSDP over data: the same rows as fsdp8.
    "zero3": {("all-gather", "data"): lambda s: 7 / 8 * (s.w + s.t),
              ("reduce-scatter", "data"): lambda s: 7 / 8 * s.w,
              ("all-to-all", "data"): lambda s: 2 * 7 / 8 * s.a},                 # the embedding's rows
    "fsdp8": {("all-gather", "fsdp"): lambda s: 7 / 8 * (s.w + s.t),
              ("reduce-scatter", "fsdp"): lambda s: 7 / 8 * s.w,
              ("all-to-all", "fsdp"): lambda s: 2 * 7 / 8 * s.a},
    "data2_fsdp4": {("all-gather", "fsdp"): lambda s: 3 / 4 * (s.w + s.t),
                    ("reduce-scatter", "fsdp"): lambda s: 3 / 4 * s.w,
                    ("all-to-all", "fsdp"): lambda s: 2 * 3 / 4 * s.a,
                    ("all-reduce", "data"): lambda s: 2 * 1 / 2 * (s.w + s.t) / 4},  # each fsdp quarter
    # Megatron: the attention and MLP outputs summed over tensor in the forward, their inputs'
    # gradients in the backward, the vocab-parallel lookup's rows and the head's input gradient.
    "tensor4": {("all-reduce", "tensor"): lambda s: 2 * 3 / 4 * L7 * s.a,
                ("all-reduce", "data"): lambda s: 2 * 1 / 2 * (s.w + s.t) / 4},   # each tensor quarter
    # Sequence parallel: each all-reduce of a layer becomes an all-gather and a reduce-scatter (here
    # RS as AR, 7 a layer); the lookup reduce-scatters its rows, the head gathers its input.
    "tensor4_sp": {("all-gather", "tensor"): lambda s: 3 / 4 * L4 * s.a,
                   ("all-reduce", "tensor"): lambda s: 2 * 3 / 4 * (L7 - 2) * s.a,
                   ("reduce-scatter", "tensor"): lambda s: 2 * 3 / 4 * s.a,
                   ("all-reduce", "data"): lambda s: 2 * 1 / 2 * (s.w + s.t) / 4},
    # Ring: keys and values pass 3 hops a layer forward and again in the backward's second ring
    # pass, their dK and dV sums 4 hops behind them (the last one home). Each layer maps over the
    # rows and the length (parallel.fsdp): its gradients are summed over data and sequence at once.
    "sequence4_ring": {("collective-permute", "sequence"): lambda s: 2 * (3 + 3 + 4) * 2 * s.kv,
                       ("all-reduce", "data+sequence"): lambda s: 2 * 7 / 8 * (s.w + s.t)},
    # All-gather: keys and values gathered once a layer, their gradients reduce-scattered.
    "sequence4_all_gather": {("all-gather", "sequence"): lambda s: 3 / 4 * 4 * 2 * s.kv * 2,
                             ("reduce-scatter", "sequence"): lambda s: 3 * 2 * s.kv * 2,
                             ("all-reduce", "data+sequence"): lambda s: 2 * 7 / 8 * (s.w + s.t)},
    # Ulysses: queries, keys, values (its 2 KV heads repeated to 4, too few to split 4 ways) and
    # the output each all-to-all'd once a layer forward and once backward; the positions and
    # segment ids are gathered too (int32, under 2% of W).
    "sequence4_ulysses": {("all-to-all", "sequence"): lambda s: s.layers * 2 * 3 / 4 * (2 * s.a + 2 * 2 * s.kv),
                          ("all-reduce", "data+sequence"): lambda s: 2 * 7 / 8 * (s.w + s.t)},
    # GPipe, P=2 stages, M=4 microbatches, run by the schedule executor: each of its 2M+2(P-1)
    # ticks passes one microbatch's activations forward and one's gradients back; each stage's
    # layer gradients are summed over data once, and the embedding and head gradients (first and
    # last stage) over data and pipeline together. No activation is summed over the stages.
    "pipeline2_gpipe": {("collective-permute", "pipeline"): lambda s: 2 * (2 * 4 + 2) * s.a / 4,
                        ("all-reduce", "data+pipeline"): lambda s: 2 * 7 / 8 * (s.w - s.layers * s.layer),
                        ("all-reduce", "data"): lambda s: 2 * 3 / 4 * s.layers * s.layer / 2},
    # Circular, V=2: 2VM+2(P-1) ticks, and the layers regrouped once a step (all-to-all of half a stage).
    "pipeline2_circular": {("collective-permute", "pipeline"): lambda s: 2 * (2 * 2 * 4 + 2) * s.a / 4,
                           ("all-to-all", "pipeline"): lambda s: 2 * 1 / 2 * s.layers * s.layer / 2,
                           ("all-reduce", "data+pipeline"): lambda s: 2 * 7 / 8 * (s.w - s.layers * s.layer),
                           ("all-reduce", "data"): lambda s: 2 * 3 / 4 * s.layers * s.layer / 2},
    # Experts: tokens to their experts and back, forward and backward (and the embedding's rows, as
    # under fsdp); each device holds its experts, and a quarter of every other weight, split over
    # expert as FSDP splits it: gathered whole (the head again, +T), gradients reduce-scattered;
    # each device's quarter of every gradient summed over data.
    "expert4": {("all-to-all", "expert"): lambda s: 4 * s.moe_layers * 3 / 4 * s.dispatch + 2 * 3 / 4 * s.a,
                ("all-gather", "expert"): lambda s: 3 / 4 * (s.w - s.experts + s.t),
                ("reduce-scatter", "expert"): lambda s: 3 / 4 * (s.w - s.experts),
                ("all-reduce", "data"): lambda s: 2 * 1 / 2 * (s.w + s.t) / 4},
}


@pytest.mark.parametrize("name", list(COLLECTIVES_SPEC))
def test_each_layout_sends_what_the_spec_says_over_the_axes_it_names(plans, name):
    plan = plans[name].to_json()  # as --json prints it
    assert_sends(plan, COLLECTIVES_SPEC[name], Sizes.of(_layout_config(name), plan))


@pytest.mark.parametrize("name", ["tensor4_sp", "fsdp8", "zero3", "mixed"])
def test_no_device_holds_the_whole_table_or_the_whole_logits(name):
    """The vocabulary split over tensor (Megatron's) or the table along d_model (FSDP, ZeRO-3):
    the lookup, the head and the loss work on each device's part. With a vocabulary of 448 (a
    size nothing else in the model has), the only arrays in the compiled step with the whole
    vocabulary are a device's own slice of the table, [448, 128/8]: nothing holds the whole table
    (448 x 128) or the logits of its tokens over the whole vocabulary."""
    text = compile_plan(_config("mesh.data=1", *LAYOUTS[name], "model.vocab_size=448"), "cpu")[1].as_text()
    assert max(vocabulary_arrays(text, 448), default=0) <= 128 // 8
    if name.startswith("tensor"):
        assert re.search(r"f32\[\d+,112\]", text), "expected logits split 4 ways over the vocabulary"


def test_advice_names_the_biggest_contributor(plans):
    config = config_lib.load(str(ROOT / "configs" / "tiny.py"))
    lines = advice(plans["data8"], config, limit_bytes=1024)
    assert lines[0].startswith("does not fit") and "temp" in lines[0] and "model.remat" in lines[1]


JSON_KEYS = ["mesh", "zero_stage", "remat", "pipeline", "platform", "compute_dtype", "num_params", "compile_s",
             "per_device_bytes", "argument_bytes", "compiled_bytes", "host_bytes", "expected_bytes", "collectives",
             "collectives_by_axis", "flops", "expected", "overlap", "windows", "notes", "frozen"]


def test_the_plans_json_has_the_keys_it_always_had(plans):
    """`to_json()` is the contract `--json` prints: these keys in this order (the target's four are
    added by the CLI), rows as plain dicts and lists, a pipeline's details only with a pipeline."""
    pipelined, flat = plans["pipeline2_gpipe"].to_json(), plans["data8"].to_json()
    assert list(flat) == JSON_KEYS and json.loads(json.dumps(pipelined)) == pipelined
    assert list(flat["pipeline"]) == ["stages", "schedule", "microbatches", "virtual_stages", "bubble_fraction"]
    assert list(pipelined["pipeline"]) == ["stages", "schedule", "microbatches", "virtual_stages", "ticks",
                                           "bubble_fraction", "in_flight", "drawing"]
    rows = flat["per_device_bytes"]  # `frozen`: a LoRA run's base (tests/test_lora.py), 0 here
    assert list(rows) == ["params", "opt_state", "other_args", "temp", "outputs", "total", "grads", "frozen"]
    assert rows["total"] == sum(list(rows.values())[:5]) + rows["frozen"] and rows["frozen"] == 0
    assert list(flat["collectives_by_axis"]["all-reduce"]["data"]) == ["count", "bytes", "sent_bytes"]
    assert list(flat["expected"]) == ["dot_flops", "collectives_by_axis"] and isinstance(flat["notes"], list)
    # Without a target's rates the overlap has no hidden and exposed bytes; its bytes are the
    # expected run's, and on XLA:CPU every collective blocks.
    assert list(flat["overlap"]["data"]) == ["sent_bytes", "async_bytes", "flops_beside"]
    for plan in (flat, pipelined):
        for axes, row in plan["overlap"].items():
            sent = sum(over[axes]["sent_bytes"] for over in plan["expected"]["collectives_by_axis"].values()
                       if axes in over)
            assert row["sent_bytes"] == pytest.approx(sent) and row["async_bytes"] == 0, axes
    assert "pipeline: gpipe, 2 stages" in table(plans["pipeline2_gpipe"])


def test_cli_json_reports_the_arithmetic():
    """`--json` for tiny.py on data=8 with ZeRO-1, by hand: N = 426,624 parameters (2 layers of
    attention 49,152 and SwiGLU 147,456, their 4 norm scales, the tied 256 x 128 table and the
    final norm); whole float32 parameters and gradients (4N bytes a device), Adam's two moments
    split 8 ways (8N / 8, beside its step count); the gradient all-reduced once, with the tied
    table's second term (4N + 4 x 256 x 128 bytes)."""
    result = main_cli(["--config=configs/tiny.py", "--config.mesh.data=8", "--config.zero_stage=1", "--json"],
                      module="jaxscale.plan")
    assert result.returncode == 0, result.stderr[-2000:]
    plan, n = json.loads(result.stdout), 426_624
    assert plan["num_params"] == n
    assert plan["expected_bytes"] == {"params": 4 * n, "grads": 4 * n, "opt_state": n}
    got = plan["per_device_bytes"]
    assert (got["params"], got["grads"]) == (4 * n, 4 * n) and got["opt_state"] == pytest.approx(n, abs=64)
    assert got["total"] >= got["params"] + got["opt_state"] + got["grads"]  # the gradients are temporaries
    assert plan["collectives"]["all-reduce"]["bytes"] == pytest.approx(4 * n + 4 * 256 * 128, rel=1e-3)
    assert plan["warnings"] == []


def test_cli_bad_input_exits_2():
    result = run_cli(["--config=configs/tiny.py", "--config.mesh.tensor=3"], module="jaxscale.plan")
    assert result.returncode == 2 and "mesh.tensor=3" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_step_the_compiler_cannot_place_is_said_not_to_fit(monkeypatch):
    """The TPU compiler places every buffer and refuses a step whose temporaries exceed the HBM
    (DeepSeek-V3 on v5p-512 at expert=256: 103.69G of 95.74G): one line, exit 1, not a traceback."""
    import jax

    from jaxscale import plan

    def refuse(*_):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                         "for HLO temporaries (103.69G) exceeds available HBM (95.74G).\nmore")
    monkeypatch.setattr(plan, "compile_plan", refuse)
    result = main_cli(["--config=configs/tiny.py"], module="jaxscale.plan")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "does not fit" in result.stderr and "(103.69G) exceeds available HBM (95.74G)" in result.stderr


def _drawing(stages: int, ticks_each_way: int) -> str:
    """The table of a schedule that runs every forward before any backward: stage s idles s ticks,
    runs its forwards, idles 2(P-1-s) ticks while the last stage turns round, runs its backwards
    and idles s ticks more."""
    return "\n".join(f"stage {s}: " + "." * s + "F" * ticks_each_way + "." * 2 * (stages - 1 - s)
                     + "B" * ticks_each_way + "." * s for s in range(stages))


@pytest.mark.parametrize("name", ["pipeline2_gpipe", "pipeline2_circular"])
def test_pipeline_schedule_is_drawn_with_its_bubble(plans, name):
    """From the config's P stages, M microbatches and V virtual stages a device (GPipe: 1): each
    stage runs VM forwards and VM backwards in 2(VM + P - 1) ticks, idle in 2(P - 1) of them
    ((P-1)/(VM+P-1) of the stage-ticks), holding all VM microbatches' activations at once."""
    config, pipe = _layout_config(name), plans[name].pipeline
    p, m = config.mesh.pipeline, config.pipeline.microbatches
    v = config.pipeline.virtual_stages
    assert pipe.ticks == 2 * (v * m + p - 1) and pipe.in_flight == (v * m,) * p
    assert pipe.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert pipe.drawing == _drawing(p, v * m)


def test_planning_a_gpu_run_on_a_cpu_host():
    plan = make_plan(_config("mesh.data=8"), "gpu")
    assert plan["compute_dtype"] == "bfloat16"  # tiny.py names no dtype: a GPU's default
    assert plan["notes"] and plan["notes"][0].startswith("attention: planned with the xla kernel")
