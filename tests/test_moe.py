"""Mixture of experts: routing by hand and against transformers' routers, the layer against a
dense reference, expert parallelism against one device, PartitionSpecs, the planner, decoding,
validation and the CLI."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import ROOT, LazyModule, build_for, initial_state, main_cli, make_layout
from jaxscale import config as config_lib
from jaxscale.analysis import mfu
from jaxscale.errors import ConfigError
from jaxscale.models import LanguageModel, ModelSpec, Strategy
from jaxscale.models.moe import MoE, MoESpec, capacity, expert_mlp, route, slices
from jaxscale.validate import validate

torch = LazyModule("torch")

# 4 layers in groups of 2 (dense, then MoE); 8 experts, top-2. A capacity factor of
# num_experts/top_k gives every expert room for a whole sequence: nothing is ever dropped.
SPEC = ModelSpec(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                 moe=MoESpec(num_experts=8, top_k=2, capacity_factor=4.0, every_n_layers=2, d_ff=64))


def _with(spec, **moe):
    return ModelSpec(**{**spec.__dict__, "moe": MoESpec(**{**spec.moe.__dict__, **moe})})


# --- routing, computed by hand -------------------------------------------------------------

# Row 0: four tokens over 3 experts; logits = log(probabilities) + c, so softmax gives the
# probabilities exactly and logsumexp = c.
PROBS = np.array([[[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.7, 0.2, 0.1], [0.1, 0.5, 0.4]],
                  [[0.2, 0.3, 0.5]] * 4])
SHIFT = np.array([[1.0, -2.0, 0.5, 0.0], [0.0] * 4])


def test_routing_by_hand():
    """top_k=2, capacity 2 per expert and row: first choices queue before second choices."""
    r = route(jnp.asarray(np.log(PROBS) + SHIFT[..., None], jnp.float32), top_k=2, capacity_per_row=2)
    # Row 0: choices t0 (e0, e1), t1 (e0, e2), t2 (e0, e1), t3 (e1, e2). Queue: first choices
    # e0: t0, t1, t2 | e1: t3; then second choices e1: t0, t2 | e2: t1, t3. Capacity 2 drops
    # t2's first choice (3rd in e0's queue) and its second (3rd in e1's).
    # Row 1: every token picks e2 then e1; positions 0..3 in both, so t2 and t3 drop twice.
    np.testing.assert_array_equal(r.experts, [[[0, 1], [0, 2], [0, 1], [1, 2]], [[2, 1]] * 4])
    np.testing.assert_array_equal(r.positions, [[[0, 1], [1, 0], [2, 2], [0, 1]], [[0, 0], [1, 1], [2, 2], [3, 3]]])
    np.testing.assert_array_equal(r.keep, [[[1, 1], [1, 1], [0, 0], [1, 1]], [[1, 1], [1, 1], [0, 0], [0, 0]]])
    np.testing.assert_array_equal(r.counts, [[3, 3, 2], [0, 4, 4]])
    # Combine weights: the two probabilities renormalised, 0 where dropped.
    np.testing.assert_allclose(r.weights, [[[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.9, 0.3 / 0.9], [0, 0],
                                            [0.5 / 0.9, 0.4 / 0.9]],
                                           [[0.5 / 0.8, 0.3 / 0.8]] * 2 + [[0, 0]] * 2], rtol=1e-6)
    # Balancing loss per row: 3 * sum_e (assignments_e / 8) * mean_prob_e, then the mean over rows.
    row0 = 3 * (3 / 8 * (0.5 + 0.6 + 0.7 + 0.1) / 4 + 3 / 8 * (0.3 + 0.1 + 0.2 + 0.5) / 4
                + 2 / 8 * (0.2 + 0.3 + 0.1 + 0.4) / 4)
    row1 = 3 * (0 * 0.2 + 4 / 8 * 0.3 + 4 / 8 * 0.5)
    assert row0 == pytest.approx(1.03125) and row1 == pytest.approx(1.2)
    np.testing.assert_allclose(r.aux_loss, (row0 + row1) / 2, rtol=1e-6)
    np.testing.assert_allclose(r.z_loss, (1 + 4 + 0.25 + 0) / 8, rtol=1e-6)  # mean of logsumexp^2 = c^2
    np.testing.assert_allclose(r.dropped, 6 / 16)


def test_a_selection_bias_chooses_but_does_not_weigh():
    """Balancing by bias (DeepSeek-V3): probabilities + bias pick the experts, the probabilities
    alone weigh them. Row 1 prefers e2, e1 (0.5, 0.3); a bias of 0.4 on e0 makes it e0 (0.2 + 0.4), e2."""
    r = route(jnp.asarray(np.log(PROBS[1:])), top_k=2, capacity_per_row=4, bias_X=jnp.array([0.4, 0.0, 0.0]))
    np.testing.assert_array_equal(r.experts, [[[0, 2]] * 4])
    np.testing.assert_allclose(r.weights, [[[0.2 / 0.7, 0.5 / 0.7]] * 4], rtol=1e-6)


def test_top_1_keeps_the_raw_probability():
    """Switch: with one choice the weight is the router probability (not renormalised to 1)."""
    r = route(jnp.asarray(np.log(PROBS[:1]), jnp.float32), top_k=1, capacity_per_row=2)
    np.testing.assert_array_equal(r.experts[..., 0], [[0, 0, 0, 1]])
    np.testing.assert_allclose(r.weights[..., 0], [[0.5, 0.6, 0.0, 0.5]], rtol=1e-6)  # t2: third for e0
    np.testing.assert_allclose(r.aux_loss, 3 * (3 / 4 * 0.475 + 1 / 4 * 0.275), rtol=1e-6)


def _hf_router(module: str, name: str, config: str, width: int, **fields):
    """transformers' router class `name` (from models.<module>) with `width` experts and inputs,
    its weight the identity: its input rows are the router logits."""
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    configuration = pytest.importorskip(f"transformers.models.{module}.configuration_{module}")
    if not hasattr(modeling, name):
        pytest.skip(f"this transformers has no {name}")
    router = getattr(modeling, name)(getattr(configuration, config)(hidden_size=width, **fields))
    with torch.no_grad():
        router.weight.copy_(torch.eye(width))
    return router


def _by_expert(experts, weights):
    """Each token's (expert, weight) pairs ordered by expert: torch.topk(sorted=False) has no set order."""
    experts, weights = np.asarray(experts), np.asarray(weights)
    order = np.argsort(experts, -1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


def test_sigmoid_group_limited_routing_equals_transformers_deepseek_v3():
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter) on the same logits and selection
    bias: sigmoid scores, 16 experts in 4 groups of which each token may use its 2 best, the
    chosen scores renormalised and scaled by 2.5; the same experts and combine weights for top_k
    2 to 4. Continuous random logits: no ties."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 8, 16)).astype(np.float32)
    bias = (0.3 * rng.normal(size=16)).astype(np.float32)
    options = dict(score="sigmoid", expert_groups=4, top_groups=2, routed_scale=2.5, renormalize=True)
    for k in (2, 3, 4):
        hf = _hf_router("deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3Config", 16, n_routed_experts=16,
                        num_experts_per_tok=k, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5)
        with torch.no_grad():
            hf.e_score_correction_bias.copy_(torch.from_numpy(bias))
            hf_logits, hf_weights, hf_experts = hf(torch.from_numpy(logits.reshape(16, 16)))
        np.testing.assert_array_equal(hf_logits.numpy(), logits.reshape(16, 16))  # the identity is exact
        r = route(jnp.asarray(logits), k, capacity_per_row=8, bias_X=jnp.asarray(bias), **options)
        want_experts, want_weights = _by_expert(hf_experts.numpy().reshape(2, 8, k),
                                                hf_weights.numpy().reshape(2, 8, k))
        got_experts, got_weights = _by_expert(r.experts, r.weights)
        np.testing.assert_array_equal(got_experts, want_experts, err_msg=f"top_k={k}")
        np.testing.assert_allclose(got_weights, want_weights, rtol=1e-6, err_msg=f"top_k={k}")
        np.testing.assert_allclose(r.weights.sum(-1), 2.5, rtol=1e-6)
        # the limit matters here: unlimited routing would choose other experts for some tokens
        free = route(jnp.asarray(logits), k, 8, bias_X=jnp.asarray(bias), **{**options, "top_groups": 4})
        assert (np.sort(free.experts, -1) != got_experts).any()


def test_softmax_routing_without_renormalising_equals_transformers_qwen3_moe():
    """Qwen3-MoE's router (transformers' Qwen3MoeTopKRouter) with norm_topk_prob False (the raw
    softmax probabilities of the chosen experts) and True: the same experts, in the same order,
    and combine weights."""
    logits = np.random.default_rng(1).normal(size=(2, 8, 8)).astype(np.float32)
    for norm in (False, True):
        hf = _hf_router("qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeConfig", 8, num_experts=8, num_experts_per_tok=3,
                        norm_topk_prob=norm)
        with torch.no_grad():
            _, hf_weights, hf_experts = hf(torch.from_numpy(logits.reshape(16, 8)))
        r = route(jnp.asarray(logits), 3, capacity_per_row=8, renormalize=norm)
        np.testing.assert_array_equal(r.experts, hf_experts.numpy().reshape(2, 8, 3))
        np.testing.assert_allclose(r.weights, hf_weights.float().numpy().reshape(2, 8, 3), rtol=1e-6)
        sums = np.asarray(r.weights.sum(-1))
        assert np.allclose(sums, 1, rtol=1e-6) if norm else (sums < 0.999).all()


def test_sigmoid_balancing_loss_averages_the_scores_normalised_per_token():
    """With sigmoid scores the balancing loss's mean score is that of the scores divided by their
    sum per token (DeepSeek-V3's sequence-wise balance loss); the z-loss stays logsumexp^2."""
    logits = np.random.default_rng(2).normal(size=(2, 6, 4)).astype(np.float32)
    r = route(jnp.asarray(logits), 2, capacity_per_row=6, score="sigmoid")
    scores = 1 / (1 + np.exp(-logits))
    share = (scores / scores.sum(-1, keepdims=True)).mean(1)                    # [B, X]
    fraction = np.asarray(r.counts) / (6 * 2)
    np.testing.assert_allclose(r.aux_loss, (4 * (fraction * share).sum(-1)).mean(), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(r.z_loss, (lse ** 2).mean(), rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("capacity_factor, shared", [(1.0, 0), (4.0, 0), (0.0, 0), (0.0, 2), (1.0, 1)])
def test_layer_equals_a_dense_reference(family, capacity_factor, shared):
    """Dispatch, experts and combine equal running every expert on every token and summing the
    kept choices with their weights (with drops at capacity factor 1; 0 is dropless, its experts'
    hidden width in slices), plus the shared experts' MLP on every token."""
    _against_a_dense_reference(family, capacity_factor, shared)


def test_the_hidden_width_runs_in_the_fewest_equal_slices_that_fit():
    assert [slices(width, most) for width, most in [(14336, 1024), (2048, 1024), (768, 1024), (100, 30), (96, 0)]] \
        == [14, 2, 1, 4, 1]


def test_the_layer_routes_with_its_router_options():
    """DeepSeek-V3's router options (sigmoid, 2 groups of 2 experts of which one is open,
    weights x 2.5) reach `route` from the layer: it equals the dense reference routed with them."""
    _against_a_dense_reference("llama", 0.0, 1, score="sigmoid", expert_groups=2, top_groups=1, routed_scale=2.5)


def _against_a_dense_reference(family, capacity_factor, shared, **router):
    spec = ModelSpec(family=family, num_layers=2, d_model=16, d_ff=32, num_heads=2, num_kv_heads=2,
                     moe=MoESpec(num_experts=4, top_k=2, capacity_factor=capacity_factor, num_shared=shared,
                                 hidden_chunk=8, **router),  # dropless: the hidden width in 4 slices
                     init_std=0.5)
    layer = MoE(spec, nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 10, 16))
    out, stats = layer(x)
    logits = jnp.einsum("BLD,DX->BLX", x, layer.router[...])
    r = route(logits, 2, capacity(10, spec.moe), **router)
    if router:  # the options changed the routing
        assert not np.array_equal(r.experts, route(logits, 2, capacity(10, spec.moe)).experts)
    every = expert_mlp(jnp.broadcast_to(x.reshape(1, 30, 16), (4, 30, 16)), layer.experts(), layer.kind)
    every = every.reshape(4, 3, 10, 16)  # [expert, B, L, D]
    want = sum(r.weights[..., j, None] * jnp.take_along_axis(every, r.experts[None, ..., j, None], 0)[0]
               for j in range(2))
    if shared:
        hidden = (layer.shared.w_gate if family == "llama" else layer.shared.w_in)[...].shape
        assert hidden == (16, 32 * shared)
        want = want + layer.shared(x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert (float(stats["moe_dropped"]) > 0) == (capacity_factor == 1.0)


# --- expert parallelism equals one device ----------------------------------------------------

def _batch(rows=16, length=32, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _run(layout, spec=SPEC, accum=1, steps=2, **strategy):
    """Metrics of `steps` updates of `spec` on `layout` (mesh sizes, see conftest.build_for; fp32),
    and the last state."""
    run = build_for(spec, accum=accum, rows=16, **layout, **strategy)
    state, history = initial_state(run, spec), []
    for i in range(steps):
        state, metrics = run.train_step(state, jax.device_put(_batch(seed=i), run.batch_sharding))
        history.append(jax.device_get(metrics))
    return history, state


ONE = dict(devices=1)


@pytest.fixture(scope="module")
def reference():
    return _run(ONE)[0]


def test_expert_parallel_equals_one_device(reference):
    """expert=2 x fsdp=2 x tensor=2 with ZeRO-1: loss, grad norm and router statistics of 2 steps
    within 1e-5 of one device; nothing dropped. (expert=4 x data=2: the test of drops and
    accumulation below.)"""
    got = _run(dict(expert=2, fsdp=2, tensor=2, zero_stage=1))[0]
    for g, r in zip(got, reference):
        assert g["moe_dropped"] == 0 and r["moe_dropped"] == 0
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            np.testing.assert_allclose(g[key], r[key], rtol=1e-5, err_msg=key)
    assert got[0]["moe_aux_loss"] > 0.9 and got[0]["moe_z_loss"] > 0


DROPLESS_LAYOUTS = {"one_device": dict(data=1), "expert4_data2": dict(data=2, expert=4)}


@pytest.mark.parametrize("name", DROPLESS_LAYOUTS)
def test_dropless_equals_the_capacity_path_that_drops_nothing(reference, name):
    """Grouped matmuls (capacity_factor 0) against slots with room for every token (factor 4) on
    one device: loss, grad norm and router statistics of 2 steps within 1e-5, on one device and
    with the experts split over expert=4 (rows exchanged raggedly, parallel.ragged); nothing
    dropped. The dropless experts run their hidden width (64) in 4 slices (model.moe.hidden_chunk),
    forward and backward. (Dropless inside the layers' map over data x fsdp x tensor, the hidden
    width whole: tests/test_prediction.py.)"""
    got = _run(DROPLESS_LAYOUTS[name], _with(SPEC, capacity_factor=0.0, hidden_chunk=16))[0]
    for g, r in zip(got, reference):
        assert g["moe_dropped"] == 0
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            np.testing.assert_allclose(g[key], r[key], rtol=1e-5, err_msg=key)


def test_the_tpu_compiler_runs_dropless_experts_as_ragged_dots_without_capacity_buffers():
    """tiny_moe (one dense and one MoE layer) on 8 v5e chips, one 512-token sequence a chip:
    dropless compiles to ragged dots, the capacity path to none, and its temporaries are below
    those of the capacity that drops nothing (8 experts, top-2: a factor of 4 gives every expert
    a whole sequence). With the experts split over expert=4, the rows travel by ragged
    all-to-all, there and back, forward and backward."""
    from jaxscale import plan as plan_lib
    from jaxscale.analysis import topology

    devices, _ = topology.compile_only_devices("v5e-8")
    plans = {}
    for factor, mesh in ((0, "data=8"), (4, "data=8"), (0, "expert=4")):
        config = config_lib.load(str(ROOT / "configs" / "tiny_moe.py"))
        config_lib.apply_overrides(config, [f"mesh.{mesh}", "train.global_batch_size=8", "train.seq_len=512",
                                            "model.num_layers=2", f"model.moe.capacity_factor={factor}"])
        run, compiled, _ = plan_lib.compile_plan(config, "tpu", devices)
        plans[factor, mesh] = (compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes)
    (dropless, _), (slots, _) = plans[0, "data=8"], plans[4, "data=8"]
    assert "ragged-dot" in dropless and "ragged-dot" not in slots and "ragged-all-to-all" not in dropless
    assert plans[0, "data=8"][1] < plans[4, "data=8"][1], plans
    exchanged = plans[0, "expert=4"][0]
    assert "ragged-dot" in exchanged and len(re.findall(r"= \S+ ragged-all-to-all\(", exchanged)) == 4


def test_balancing_by_the_bias_alone_adds_no_auxiliary_term_to_the_objective():
    """With bias_rate on and aux_loss_weight 0 the balancing loss is still reported, but the
    objective (what the step differentiates) is the cross entropy plus the weighted z-loss only."""
    spec = _with(SPEC, bias_rate=0.01, aux_loss_weight=0.0)
    model = LanguageModel(spec)
    batch = _batch()
    objective, metrics = jax.jit(model.loss)(model.init(jax.random.PRNGKey(0)), batch["inputs"], batch["targets"])
    assert metrics["moe_aux_loss"] > 0.5
    np.testing.assert_allclose(objective, metrics["loss"] + spec.moe.z_loss_weight * metrics["moe_z_loss"],
                               rtol=1e-7)


def _biases(layout, spec, steps, accum=1):
    """Each of `steps` updates' metrics, and the selection biases after each."""
    run = build_for(spec, accum=accum, rows=16, **layout)
    state, history, biases = initial_state(run, spec), [], []
    for i in range(steps):
        state, metrics = run.train_step(state, jax.device_put(_batch(seed=i), run.batch_sharding))
        history.append(jax.device_get(metrics))
        biases.append(np.asarray(state.params["layers"]["moe"]["mlp"]["bias_balance"]))
    return history, biases


def test_drops_accumulation_and_bias_balancing_do_not_depend_on_the_layout():
    """Routing groups are sequences: with tokens dropped (capacity factor 1), balancing by bias
    beside the auxiliary loss and 2 accumulation steps, expert=4 x data=2 still equals one device
    without accumulation over 2 steps. After one step every bias is 0 or +-rate (up for an expert
    below an even load, down above it), after two a multiple of the rate up to 2, and the split
    run moves them exactly as one device does (the load is the whole batch's)."""
    spec = _with(SPEC, capacity_factor=1.0, bias_rate=0.01)
    one, (first, second) = _biases(ONE, spec, 2)
    assert one[0]["moe_dropped"] > 0.01
    steps = np.round(first / 0.01, 4)
    assert first.shape == (2, 8) and set(steps.ravel()) <= {-1, 0, 1} and {-1, 1} <= set(steps.ravel())
    assert one[0]["moe_max_load"] > 1  # some expert above an even share
    assert set(np.round(second / 0.01, 4).ravel()) <= {-2, -1, 0, 1, 2}
    split, biases = _biases(dict(data=2, expert=4), spec, 2, accum=2)
    np.testing.assert_allclose(biases[-1], second, atol=1e-7)
    for g, r in zip(split, one):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped"):
            np.testing.assert_allclose(g[key], r[key], rtol=1e-5, err_msg=key)


KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load")


def test_moe_in_pipeline_stages_under_1f1b_equals_one_device(reference):
    """SPEC (two groups of a dense and an MoE layer) in 2 stages x expert=2 x data=2 under 1f1b
    with 4 microbatches: loss, grad norm (the router losses' gradients included, differentiated
    in the stage that routes) and router statistics (the loads summed over microbatches before
    the busiest expert is taken) of 2 steps within 1e-5 of one device."""
    got = _run(dict(pipeline=2, data=2, expert=2), schedule="1f1b", microbatches=4)[0]
    for g, r in zip(got, reference):
        for key in KEYS:
            np.testing.assert_allclose(g[key], r[key], rtol=1e-5, err_msg=key)


def test_pipeline_stages_keep_their_experts_split_over_expert():
    """tiny_moe.py in 2 stages x expert=2 x data=2 (1f1b, 4 microbatches): each device holds its
    stage's own experts through the step. No expert weight is gathered over expert (the
    all-gathers over expert move half of the stage's other matrices and of the table), and the
    experts' gradients are summed over data alone: 2 x 1/2 x E/4 (all-reducing the stage's whole
    experts over data x expert sent 2 x 3/4 x E/2, and gathering them E/4 more, measured)."""
    from jaxscale.plan import make_plan
    from sends import Sizes, sent_by_axis

    config = config_lib.load(str(ROOT / "configs" / "tiny_moe.py"))
    config_lib.apply_overrides(config, ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "pipeline.schedule=1f1b",
                                        "pipeline.microbatches=4", "train.global_batch_size=16"])
    plan = make_plan(config)
    sizes, sent, m = Sizes.of(config, plan), sent_by_axis(plan), config.model
    norms = 4 * (2 * m.num_layers + 1) * m.d_model
    stage_matrices = (sizes.w - sizes.experts - sizes.t - norms) / 2
    assert sent[("all-gather", "expert")] == pytest.approx(1 / 2 * (stage_matrices + sizes.t), rel=1e-3)
    assert sent[("all-reduce", "data")] == pytest.approx(2 * 1 / 2 * sizes.experts / 4, rel=1e-3)


def test_dropless_balanced_moe_in_interleaved_and_zero_bubble_stages_equals_one_device():
    """Every layer MoE, dropless, balancing by bias: 2 stages x 2 virtual stages (interleaved
    1F1B: each stage's loads reach their layers' biases in layer order) and zero-bubble (the
    backward split in B and W: statistics counted once) equal one device, biases included."""
    spec = _with(SPEC, capacity_factor=0.0, every_n_layers=1, bias_rate=0.01, aux_loss_weight=0.0)
    one, one_state = _run(ONE, spec)
    for schedule, virtual in (("interleaved_1f1b", 2), ("zero_bubble", 1)):
        got, state = _run(dict(pipeline=2, data=2, expert=2), spec, schedule=schedule, microbatches=4,
                          virtual_stages=virtual)
        for g, r in zip(got, one):
            for key in KEYS:
                np.testing.assert_allclose(g[key], r[key], rtol=1e-5, err_msg=f"{schedule} {key}")
        bias = state.params["layers"]["moe"]["mlp"]["bias_balance"]
        np.testing.assert_allclose(bias, one_state.params["layers"]["moe"]["mlp"]["bias_balance"], atol=1e-7)


# --- layout: PartitionSpecs, planner, decoding -----------------------------------------------

def test_expert_weights_split_over_expert_and_tensor():
    run = build_for(SPEC, expert=2, fsdp=2, tensor=2)
    layout, shardings = run.layout, run.shardings
    mlp, mu = shardings.params["layers"]["moe"]["mlp"], shardings.opt_state[1][0].mu["layers"]["moe"]["mlp"]
    assert mlp["w_gate"].spec == P(None, "expert", "fsdp", "tensor") == mu["w_gate"].spec
    assert mlp["w_down"].spec == P(None, "expert", "tensor", "fsdp")
    # Every other weight's model dimension is split over fsdp x expert (gathered where it is used)
    assert mlp["router"].spec == P(None, ("fsdp", "expert"))
    assert shardings.params["layers"]["dense"]["mlp"]["w_up"].spec == P(None, ("fsdp", "expert"), "tensor")
    assert shardings.params["layers"]["moe"]["attn"]["wq"].spec == P(None, ("fsdp", "expert"), "tensor")
    assert layout.batch_sharding().spec == P(("fsdp", "expert"))  # expert is a batch axis elsewhere
    gpt2 = ModelSpec(**{**SPEC.__dict__, "family": "gpt2", "max_seq_len": 64})
    specs = build_for(gpt2, data=2, expert=4).shardings.params["layers"]["moe"]["mlp"]
    assert specs["bias_in"].spec == P(None, "expert") and specs["w_out"].spec == P(None, "expert")


def test_planner_divides_expert_weights_by_expert():
    """tiny_moe.py on data=2 x expert=4, by hand from the config: each device holds a quarter of
    the experts' weights (gate, up, down: 3 x d_model x moe.d_ff each, in every MoE layer) and a
    quarter of every other matrix (4 layers of attention, 2 dense SwiGLU MLPs, 2 routers, the tied
    table: their d_model split over expert as over fsdp), the norms whole: 4 bytes a parameter for
    params and grads, 8 for Adam's moments. The layers gather their matrices whole over expert
    (forward only: no remat), the loss gathers the table's chunks forward and backward and the
    expert group's target ids once; tokens travel to the experts by all-to-all. (test_plan's
    "expert4" config: the persistent compilation cache holds its step for whichever runs second.)"""
    from jaxscale.plan import make_plan

    config = config_lib.load(str(ROOT / "configs" / "tiny_moe.py"))
    config_lib.apply_overrides(config, ["mesh.data=2", "mesh.expert=4"])
    m = config.model
    head_dim, moe_layers = m.d_model // m.num_heads, m.num_layers // m.moe.every_n_layers
    attention = 2 * m.d_model * (m.num_heads + m.num_kv_heads) * head_dim
    experts = moe_layers * m.moe.num_experts * 3 * m.d_model * m.moe.d_ff
    layer_matrices = (m.num_layers * attention + (m.num_layers - moe_layers) * 3 * m.d_model * m.d_ff
                      + moe_layers * m.d_model * m.moe.num_experts)
    table, norms = m.vocab_size * m.d_model, (2 * m.num_layers + 1) * m.d_model
    plan = make_plan(config)
    assert plan["num_params"] == layer_matrices + table + norms + experts == 1_707_136
    per_device = (layer_matrices + table + experts) / config.mesh.expert + norms
    for key, bytes_per_param in (("params", 4), ("grads", 4), ("opt_state", 8)):
        assert plan["per_device_bytes"][key] == pytest.approx(bytes_per_param * per_device, rel=0.01), key
    group_rows = config.train.global_batch_size // config.mesh.data
    gathered = 4 * (layer_matrices + 2 * table) + 4 * group_rows * config.train.seq_len
    assert plan["collectives"]["all-gather"]["bytes"] == gathered
    # two all-to-alls (dispatch, combine) per MoE layer forward, two more backward: 2 MoE layers;
    # and the embeddings' rows back to their devices from the table's split, forward and backward
    assert plan["collectives"]["all-to-all"]["count"] == 8 + 2


@pytest.mark.parametrize("family, every", [("llama", 2), ("gpt2", 1)])
def test_decode_equals_the_full_forward(family, every):
    spec = ModelSpec(family=family, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2 if family == "llama" else 4,
                     d_ff=64, vocab_size=100, max_seq_len=16, init_std=0.2,
                     moe=MoESpec(num_experts=4, top_k=2, capacity_factor=2.0, every_n_layers=every))
    model = LanguageModel(spec)
    params = model.init(jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10), tokens.shape)
    cache, pieces, decode = model.init_cache(2, 12), [], jax.jit(model.decode)
    for start, stop in [(0, 6)] + [(i, i + 1) for i in range(6, 10)]:
        logits, cache = decode(params, tokens[:, start:stop], positions[:, start:stop], cache)
        pieces.append(logits)
    full, stats = model.apply_with_stats(params, tokens)
    assert float(stats["moe_dropped"]) == 0
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, rtol=0, atol=1e-5)


def test_active_parameters_for_mfu():
    model = LanguageModel(SPEC)
    n = mfu.matmul_params(model.shapes, SPEC)
    experts = 2 * 3 * 8 * 64 * 64  # 2 MoE layers x (gate, up, down) x 8 experts x d_model x expert d_ff
    assert mfu.active_params(model.shapes, SPEC) == n - experts + experts * 2 // 8
    shared = _with(SPEC, num_shared=2)  # every token uses the shared experts: all of them count
    got = mfu.active_params(LanguageModel(shared).shapes, shared)
    assert got == n - experts + experts * 2 // 8 + 2 * 3 * 64 * 128


# --- validation and the command line ----------------------------------------------------------

@pytest.mark.parametrize("overrides, field, words", [
    (["mesh.expert=2"], "mesh.expert", "model.moe.num_experts to a multiple of 2"),
    (["model.moe.num_experts=6", "mesh.expert=4"], "model.moe.num_experts", "multiple of 4"),
    (["model.moe.num_experts=8", "model.moe.top_k=9"], "model.moe.top_k", "between 1 and"),
    (["model.moe.num_experts=8", "model.moe.capacity_factor=-1"], "model.moe.capacity_factor", "0 = dropless"),
    (["model.moe.num_experts=8", "model.moe.every_n_layers=3"], "model.moe.every_n_layers",
     "divide model.num_layers=4"),
    (["model.moe.num_experts=8", "model.moe.every_n_layers=2", "mesh.pipeline=2", "pipeline.virtual_stages=2",
      "pipeline.schedule=interleaved_1f1b"], "model.num_layers", "multiple of 8 layers"),
    (["model.moe.num_experts=8", "mesh.pipeline=2", "mesh.sequence=2", "pipeline.schedule=gpipe"],
     "mesh.sequence", "mesh.sequence=1"),
    (["model.moe.num_experts=8", "model.moe.d_ff=100", "mesh.tensor=8", "mesh.data=1"], "model.moe.d_ff",
     "multiple of 8"),
    (["model.moe.num_experts=8", "mesh.expert=2", "sharding.rules.batch='data,fsdp'"], "sharding.rules.batch",
     "add expert"),
    (["model.moe.num_experts=8", "mesh.expert=4", "mesh.data=2", "train.global_batch_size=4"],
     "train.global_batch_size", "8 batch shards (data=2xexpert=4)"),
    (["model.moe.num_experts=8", "model.moe.score=foo"], "model.moe.score", "choose one of softmax, sigmoid"),
    (["model.moe.num_experts=8", "model.moe.expert_groups=3"], "model.moe.expert_groups",
     "divide model.moe.num_experts=8"),
    (["model.moe.num_experts=8", "model.moe.expert_groups=8"], "model.moe.expert_groups", "at most 4 groups"),
    (["model.moe.num_experts=8", "model.moe.expert_groups=4", "model.moe.top_groups=5"], "model.moe.top_groups",
     "between 1 and model.moe.expert_groups=4"),
    (["model.moe.num_experts=8", "model.moe.expert_groups=4", "model.moe.top_k=3"], "model.moe.top_k",
     "at most 2; raise top_groups"),
    (["model.moe.num_experts=8", "model.moe.routed_scale=0"], "model.moe.routed_scale", "must be > 0"),
    (["model.moe.num_experts=8", "model.moe.hidden_chunk=-1"], "model.moe.hidden_chunk", "must be >= 0"),
    (["model.moe.num_experts=8", "model.moe.first_dense=4"], "model.moe.first_dense", "leave MoE layers"),
    (["model.moe.num_experts=8", "model.moe.first_dense=1", "model.moe.every_n_layers=2"],
     "model.moe.every_n_layers", "less model.moe.first_dense=1"),
    (["model.moe.num_experts=8", "model.moe.first_dense=2", "mesh.pipeline=2", "pipeline.schedule=gpipe"],
     "model.moe.first_dense", "set mesh.pipeline=1"),
])
def test_bad_moe_input_names_field(overrides, field, words):
    config = config_lib.defaults()
    with pytest.raises(ConfigError) as info:
        config_lib.apply_overrides(config, overrides)
        validate(config, 8)
    assert info.value.field == field and str(info.value).startswith(field) and words in str(info.value)


def test_cli_expert_parallel_logs_the_one_device_loss(tmp_path):
    """The acceptance command: tiny_moe with expert=4 (data=-1 takes the other 2) logs the same
    step-1 loss as expert=1, and the router statistics: each expert's load (x 8, so they sum to
    8), the busiest no more than the mean of each layer's busiest, one tracker scalar each."""
    from jaxscale.tracking.fields import numeric

    records = {}
    for experts in (1, 4):
        workdir = tmp_path / f"expert{experts}"
        done = main_cli(["--config=configs/tiny_moe.py", f"--config.mesh.expert={experts}", "--config.mesh.data=-1",
                        "--config.train.steps=1", "--config.train.eval_every=0", "--config.tracking.writers=jsonl",
                        "--config.tracking.report=False", f"--workdir={workdir}"])
        assert done.returncode == 0, done.stderr[-3000:]
        records[experts] = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[0])
    one, four = records[1], records[4]
    assert one["step"] == four["step"] == 1
    np.testing.assert_allclose(four["loss"], one["loss"], rtol=1e-5)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_expert_load"):
        np.testing.assert_allclose(four[key], one[key], rtol=1e-5, err_msg=key)
    load = np.asarray(one["moe_expert_load"])
    assert load.shape == (8,) and load.sum() == pytest.approx(8.0) and load.max() <= one["moe_max_load"] + 1e-6
    assert numeric(one)["moe_expert_load/7"] == load[7]


def test_hugging_face_export_refuses_experts_its_family_has_not():
    """A llama with experts is no Hugging Face model (Mixtral and Qwen3-MoE are: tests/test_interop.py)."""
    from jaxscale.interop.hf_config import hf_config_from_spec

    with pytest.raises(ConfigError) as info:
        hf_config_from_spec(SPEC)
    assert info.value.field == "model.moe.num_experts" and "mixtral, qwen3_moe" in str(info.value)


def test_routing_under_context_parallelism_drops_the_tokens_one_device_drops():
    """With the sequence split over `sequence` the tokens compute in zig-zag order; expert queues
    still fill in token order, so with tokens dropped (capacity factor 1) the model gives the
    one-program logits (before: the zig-zag order decided which tokens were dropped)."""
    spec = _with(SPEC, capacity_factor=1.0)
    split = LanguageModel(ModelSpec(**{**spec.__dict__, "strategy": Strategy.for_layout(make_layout(sequence=2),
                                                                                        context="ring")}))
    params = split.init(jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab_size, (2, 32)), jnp.int32)
    logits, stats = jax.jit(split.apply_with_stats)(params, tokens)
    want, want_stats = split.unsharded().apply_with_stats(params, tokens)
    assert want_stats["moe_dropped"] > 0.01
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["moe_dropped"], want_stats["moe_dropped"])
