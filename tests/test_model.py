"""The transformer: shapes, causality, named axes, remat policies, structure options."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.sharding import DEFAULT_RULES

SPECS = {
    "llama_gqa_untied": ModelSpec(family="llama", num_layers=2, d_model=48, num_heads=6, num_kv_heads=2,
                                  d_ff=96, vocab_size=100, tie_embeddings=False),
    "gpt2_tied": ModelSpec(family="gpt2", num_layers=2, d_model=48, num_heads=3, num_kv_heads=3,
                           d_ff=96, vocab_size=100, max_seq_len=32),
}


def _tokens(shape=(2, 16), vocab=100, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _loss_and_grads(spec):
    """(loss, grads, compiled program's text) of the mean logsumexp of `spec`'s logits on _tokens(),
    at the parameters of seed 0: jitted value_and_grad, compiled once."""
    model = LanguageModel(spec)
    params, tokens = model.init(jax.random.PRNGKey(0)), _tokens()

    def loss(p):
        return jnp.mean(jax.nn.logsumexp(model.apply(p, tokens), -1))

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return (*compiled(params), compiled.as_text())


@functools.cache
def _scanned_llama(remat):
    """_loss_and_grads of the scanned llama_gqa_untied with `remat`, which several tests compare against."""
    return _loss_and_grads(dataclasses.replace(SPECS["llama_gqa_untied"], remat=remat))


@pytest.mark.parametrize("name", SPECS)
def test_forward_shape_and_causality(name):
    model = LanguageModel(SPECS[name])
    params = model.init(jax.random.PRNGKey(0))
    tokens = _tokens()
    logits = model.apply(params, tokens)
    assert logits.shape == (2, 16, 100) and logits.dtype == jnp.float32
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % 100)
    np.testing.assert_allclose(model.apply(params, changed)[:, :10], logits[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(model.apply(params, changed)[:, 10:], logits[:, 10:])


@pytest.mark.parametrize("name", SPECS)
def test_every_parameter_names_its_axes(name):
    model = LanguageModel(SPECS[name])
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    flat_axes = dict(jax.tree_util.tree_leaves_with_path(model.axes, is_leaf=lambda x: isinstance(x, tuple)))
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        axes = flat_axes[path]
        assert len(axes) == leaf.ndim and set(axes) <= set(DEFAULT_RULES), (path, axes)
    assert model.axes["layers"]["attn"]["wk"] == ("layers", "embed", "kv_heads", "head_dim")
    assert ("head" in shapes) == (not SPECS[name].tie_embeddings)
    assert ("pos_embed" in shapes) == (SPECS[name].arch.position == "learned")


def test_stacked_layers_have_leading_layer_dim():
    spec = SPECS["llama_gqa_untied"]
    params = jax.eval_shape(LanguageModel(spec).init, jax.random.PRNGKey(0))
    assert params["layers"]["attn"]["wq"].shape == (2, 48, 6, 8)
    assert params["layers"]["mlp"]["w_gate"].shape == (2, 48, 96)


def test_remat_policies_give_same_loss_and_grads():
    results = [_scanned_llama(remat)[:2] for remat in ("none", "full", "dots_saveable")]
    for loss, grads in results[1:]:
        np.testing.assert_allclose(loss, results[0][0], rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, results[0][1])


def test_init_independent_of_call_site():
    model = LanguageModel(SPECS["gpt2_tied"])
    eager = model.init(jax.random.PRNGKey(3))
    jitted = jax.jit(model.init)(jax.random.PRNGKey(3))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), eager, jitted)


STRATEGIES = {"ring": (dict(sequence=4), dict(context="ring")),
              "all_gather": (dict(sequence=2), dict(context="all_gather")),
              "ulysses": (dict(sequence=2), dict(context="ulysses")),
              "gpipe": (dict(pipeline=2), dict(microbatches=2))}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_parallel_strategy_is_the_same_function_outside_any_layout(name):
    """The strategy is part of the spec: called with no layout active, a model that runs ring
    attention or a pipeline gives the logits of the one-program model (fp32, 1e-5)."""
    import dataclasses

    from conftest import make_layout
    from jaxscale.models import Strategy

    sizes, options = STRATEGIES[name]
    spec = dataclasses.replace(SPECS["llama_gqa_untied"], strategy=Strategy.for_layout(make_layout(**sizes), **options))
    model = LanguageModel(spec)
    assert model.spec.strategy.describe() != "none" and model.unsharded().spec.strategy == Strategy()
    params, tokens = model.init(jax.random.PRNGKey(0)), _tokens()
    np.testing.assert_allclose(jax.jit(model.apply)(params, tokens), model.unsharded().apply(params, tokens),
                               rtol=1e-5, atol=1e-5)


def test_a_strategy_names_what_it_needs():
    from conftest import make_layout
    from jaxscale.models import Strategy

    with pytest.raises(ValueError, match="needs a layout whose mesh splits 'sequence'"):
        Strategy(make_layout(data=2), context="ring")
    pipelined = LanguageModel(ModelSpec(num_layers=2, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, strategy=
                                        Strategy.for_layout(make_layout(pipeline=2), microbatches=2)))
    with pytest.raises(ValueError, match="does not split into 2 microbatches"):
        pipelined.apply(pipelined.init(jax.random.PRNGKey(0)), _tokens((3, 8)))


# Three packed documents a row: tokens 0-4, 5-10 and 11-15 (the second row split elsewhere).
DOCUMENTS = jnp.asarray([[0] * 5 + [1] * 6 + [2] * 5, [0] * 3 + [1] * 9 + [2] * 4], jnp.int32)


@pytest.mark.parametrize("name", [None, *STRATEGIES])
def test_with_document_masking_a_document_sees_only_itself(name):
    """Changing the middle document's tokens changes its logits and no other document's, on one
    device and under each parallel strategy (the same model without segment ids: the last
    document's logits change too, so the test can fail)."""
    import dataclasses

    from conftest import make_layout
    from jaxscale.models import Strategy

    spec = SPECS["llama_gqa_untied"]
    if name is not None:
        sizes, options = STRATEGIES[name]
        spec = dataclasses.replace(spec, strategy=Strategy.for_layout(make_layout(**sizes), **options))
    model = LanguageModel(spec)
    params, tokens = model.init(jax.random.PRNGKey(0)), _tokens()
    middle = DOCUMENTS == 1
    changed = jnp.where(middle, (tokens + 1) % 100, tokens)
    apply = jax.jit(model.apply)
    before, after = apply(params, tokens, None, DOCUMENTS), apply(params, changed, None, DOCUMENTS)
    np.testing.assert_allclose(after[~middle], before[~middle], rtol=1e-5, atol=1e-5)
    assert not np.allclose(after[middle], before[middle])
    if name is None:
        unmasked = apply(params, changed) - apply(params, tokens)
        assert not np.allclose(unmasked[DOCUMENTS == 2], 0)


@pytest.mark.parametrize("name", SPECS)
def test_a_packed_document_gives_the_logits_it_gives_alone(name):
    """Positions restart at each document (learned positions as RoPE): a document packed after
    another gives, for its own tokens, the logits it gives at the start of a row."""
    model = LanguageModel(SPECS[name])
    params, tokens = model.init(jax.random.PRNGKey(0)), _tokens((1, 16))
    alone = model.apply(params, tokens[:, 5:])
    packed = model.apply(params, tokens, None, DOCUMENTS[:1].clip(0, 1))
    np.testing.assert_allclose(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_are_the_scanned_function_without_the_loop(remat):
    """model.layer_loop: the same parameters (still stacked), the same loss and gradients; the
    unrolled program has no loop left."""
    loss_s, grads_s, scanned = _scanned_llama(remat)
    spec = dataclasses.replace(SPECS["llama_gqa_untied"], remat=remat, scan_layers=False)
    loss_u, grads_u, unrolled = _loss_and_grads(spec)
    np.testing.assert_allclose(loss_u, loss_s, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_u, grads_s)
    # The scan's loops (forward and backward) hold the blockwise attention's own loops inside.
    assert scanned.count(" while(") > unrolled.count(" while(")
    assert "dynamic-update-slice" in scanned  # the scan stacks its residuals; unrolled, nothing to stack


def test_a_layer_pattern_gives_each_layer_its_kind_in_every_loop():
    """Five layers of the pattern LLG (windows of 3 tokens, rotated by their own RoPE base): the
    scan over the whole period and the two layers past it, the unrolled layers, and decoding
    with the KV cache (a prompt longer than the window, then a token a call; the local layers'
    caches rings of 3 slots) compute one function; the windows change it."""
    spec = dataclasses.replace(SPECS["llama_gqa_untied"], num_layers=5, layer_pattern="LLG", sliding_window=3,
                               local_rope_theta=500.0, remat="full")  # scanned: remat by Transformer._in_turn
    tokens, out = _tokens(), {}
    for scan in (True, False):
        model = LanguageModel(dataclasses.replace(spec, scan_layers=scan))
        params = model.init(jax.random.PRNGKey(0))
        out[scan] = jax.jit(jax.value_and_grad(lambda p, model=model: model.loss(p, tokens[:, :-1], tokens[:, 1:])[0]))(
            params)
    np.testing.assert_allclose(out[False][0], out[True][0], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out[False][1], out[True][1])
    model = LanguageModel(spec)
    logits = model.apply(params, tokens)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)
    cache = model.init_cache(2, 16)  # the four local layers hold their window of 3 tokens, the global one all 16
    assert {name: stack["k"].shape[:3] for name, stack in cache.items()} == {"local": (4, 2, 3), "global": (1, 2, 16)}
    prompt, cache = model.decode(params, tokens[:, :10], positions[:, :10], cache)
    steps = [prompt]
    for i in range(10, 16):
        step, cache = model.decode(params, tokens[:, i:i + 1], positions[:, i:i + 1], cache)
        steps.append(step)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), logits, rtol=1e-5, atol=1e-5)
    glob = LanguageModel(dataclasses.replace(spec, layer_pattern="G"))
    assert not np.allclose(glob.apply(params, tokens)[:, 3:], logits[:, 3:], atol=1e-3)  # beyond the window
    np.testing.assert_allclose(glob.apply(params, tokens)[:, :1], logits[:, :1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform, devices, layers, scan", [
    ("cpu", 1, 2, False), ("cpu", 1, 9, True), ("cpu", 8, 2, True), ("tpu", 1, 2, True), ("gpu", 1, 2, True)])
def test_layer_loop_auto_unrolls_small_models_on_one_cpu_device(platform, devices, layers, scan):
    from types import SimpleNamespace

    from jaxscale.models.language_model import _one_cpu_device, resolve_layer_loop

    one_cpu = _one_cpu_device(platform, SimpleNamespace(mesh=SimpleNamespace(size=devices)))
    assert one_cpu == (platform == "cpu" and devices == 1)  # the CPU formulations (models.matmul) too
    assert resolve_layer_loop(SimpleNamespace(layer_loop="auto", num_layers=layers), one_cpu) is scan
    for forced in ("scan", "unroll"):
        assert resolve_layer_loop(SimpleNamespace(layer_loop=forced, num_layers=layers), one_cpu) is (forced == "scan")


@pytest.mark.parametrize("from_activation", [False, True])
@pytest.mark.parametrize("k, x_shape, w_shape", [(1, (2, 5, 6), (6, 3, 4)), (2, (2, 5, 3, 4), (3, 4, 6))])
def test_cpu_projection_is_the_einsum_with_the_same_gradients(k, x_shape, w_shape, from_activation):
    from jaxscale.models.matmul import project

    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (x_shape, w_shape))

    def loss(x, w, cpu):
        return jnp.sum(jnp.sin(project(jnp.tanh(x), w, k, cpu, from_activation)))

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
    plain, cpu = (grad(x, w, c) for c in (False, True))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), cpu, plain)
    # an activation's output reaches its weight gradient whole, through a conditional fusion cannot enter
    assert (" conditional(" in grad.lower(x, w, True).compile().as_text()) == from_activation


@pytest.mark.parametrize("remat", ["none", "dots_saveable"])
def test_the_cpu_formulation_gives_the_same_loss_and_grads(remat):
    for name, spec in SPECS.items():
        loss_a, grads_a, _ = (_scanned_llama(remat) if name == "llama_gqa_untied"
                              else _loss_and_grads(dataclasses.replace(spec, remat=remat)))
        loss_b, grads_b, _ = _loss_and_grads(dataclasses.replace(spec, remat=remat, cpu_matmul=True, scan_layers=False))
        np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_b, grads_a)


# --- the model as data: a family is a preset of structure options (models.families) --------------

def test_a_family_is_a_preset_of_options():
    from jaxscale.models.families import FAMILIES

    llama, gpt2 = SPECS["llama_gqa_untied"], SPECS["gpt2_tied"]
    assert llama.arch == FAMILIES["llama"] and gpt2.arch == FAMILIES["gpt2"]
    assert dataclasses.replace(llama, family="gpt2").arch == FAMILIES["gpt2"]  # the options follow the family
    # The options build the model, not the family's name: gpt2's options under another name
    # give the same parameters and the same logits.
    named = LanguageModel(gpt2)
    options = LanguageModel(dataclasses.replace(gpt2, family="llama", architecture=FAMILIES["gpt2"]))
    assert jax.tree.map(lambda s: s.shape, named.shapes) == jax.tree.map(lambda s: s.shape, options.shapes)
    params = named.init(jax.random.PRNGKey(0))
    jax.tree.map(np.testing.assert_array_equal, params, options.init(jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(named.apply(params, _tokens()), options.apply(params, _tokens()))


@pytest.mark.parametrize("experts", [0, 4])
def test_options_combine_freely(experts):
    """A mix neither family has: LayerNorm, learned positions and a SwiGLU with biases, no
    attention biases; dense or MoE (its experts and shared experts get the biases too)."""
    from jaxscale.models.families import Architecture
    from jaxscale.models.moe import MoESpec

    arch = Architecture(norm="layernorm", mlp="swiglu", mlp_bias=True, position="learned", attention_bias="none")
    spec = dataclasses.replace(SPECS["llama_gqa_untied"], architecture=arch, max_seq_len=16,
                               moe=MoESpec(num_experts=experts, num_shared=1))
    model = LanguageModel(spec)
    params = model.init(jax.random.PRNGKey(0))
    layers = params["layers"]["moe"] if experts else params["layers"]
    mlp = layers["mlp"]
    assert {"w_gate", "w_up", "w_down", "bias_gate", "bias_up", "bias_down"} <= set(mlp)
    assert set(layers["attn"]) == {"wq", "wk", "wv", "wo"} and "pos_embed" in params
    assert set(layers["attn_norm"]) == {"scale", "bias"}
    if experts:
        assert model.axes["layers"]["moe"]["mlp"]["bias_gate"] == ("layers", "experts", "mlp")
        assert model.axes["layers"]["moe"]["mlp"]["bias_down"] == ("layers", "experts", "embed")
        assert "bias_up" in mlp["shared"]
    else:
        assert model.axes["layers"]["mlp"]["bias_down"] == ("layers", "norm")
    tokens = _tokens()
    biased = jax.tree.map(lambda p: p + 0.1, params)  # non-zero biases must change the output
    assert not np.allclose(model.apply(biased, tokens), model.apply(params, tokens))
    grads = jax.grad(lambda p: model.loss(p, tokens[:, :-1], tokens[:, 1:])[0])(params)
    grad_layers = grads["layers"]["moe"] if experts else grads["layers"]
    assert float(jnp.abs(grad_layers["mlp"]["bias_gate"]).sum()) > 0


def test_an_unknown_option_is_refused():
    from jaxscale.models.families import Architecture

    with pytest.raises(ValueError, match="norm='batchnorm'"):
        ModelSpec(architecture=Architecture(norm="batchnorm"))
