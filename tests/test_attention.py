"""Attention kernel selection: cuDNN where it can run, xla elsewhere, one line saying which. Sliding
windows and soft-capped logits: each kernel against a dense reference, and the work a window saves
read from the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.analysis import hlo_stats
from jaxscale.build import build
from jaxscale.errors import ConfigError
from jaxscale.kernels import flash, splash
from jaxscale.models import attention
from jaxscale.models.attention import Placement, cached_attention, document_positions, resolve_impl, self_attention


def test_auto_and_fallbacks():
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 64)[0] == "cudnn"
    assert resolve_impl("auto", "cpu", jnp.float32, 64) == (
        "xla", "attention: xla (cuDNN attention needs an NVIDIA GPU (platform is cpu))")
    assert resolve_impl("auto", "gpu", jnp.float32, 64)[0] == "xla"      # fp32 compute
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 12)[0] == "xla"     # head_dim not a multiple of 8
    assert resolve_impl("xla", "gpu", jnp.bfloat16, 64) == ("xla", None)
    impl, note = resolve_impl("cudnn", "tpu", jnp.bfloat16, 64)
    assert impl == "xla" and note.startswith("warning: model.attention.impl=cudnn falls back to xla")


def test_a_deterministic_run_takes_no_cudnn_attention():
    impl, note = resolve_impl("auto", "gpu", jnp.bfloat16, 64, deterministic=True)
    assert impl == "xla" and "not deterministic" in note
    with pytest.raises(ConfigError) as info:
        resolve_impl("cudnn", "gpu", jnp.bfloat16, 64, deterministic=True)
    assert info.value.field == "model.attention.impl" and "set model.attention.impl=xla" in str(info.value)


def test_soft_capped_logits_take_no_cudnn_attention():
    reason = "cuDNN attention cannot soft-cap attention logits (model.attn_logit_softcap)"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 64, softcap=50.0) == ("xla", f"attention: xla ({reason})")
    assert resolve_impl("cudnn", "gpu", jnp.bfloat16, 64, softcap=50.0) == (
        "xla", f"warning: model.attention.impl=cudnn falls back to xla: {reason}")
    assert resolve_impl("auto", "tpu", jnp.bfloat16, 64, length=256, softcap=50.0)[0] == "splash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 64, softcap=0.0)[0] == "cudnn"


def test_latent_attention_takes_cudnn_and_never_splash():
    """Latent attention's query and key width decides cuDNN (DeepSeek-V3's 192 fits its 256);
    splash is refused in one line."""
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 192, latent=True) == (
        "cudnn", "attention: cudnn flash attention (model.attention.impl=auto)")
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 320, latent=True)[0] == "xla"
    assert resolve_impl("auto", "tpu", jnp.bfloat16, 192, length=256, latent=True) == (
        "xla", f"attention: xla ({attention.LATENT})")


def test_values_narrower_than_keys_widened_for_a_kernel_that_needs_one_width():
    """A kernel that takes only values as wide as the keys (here XLA's reference attention, as
    cuDNN's through jax.nn) computes latent attention's narrower values through `widened`:
    output and gradients equal the blockwise kernel's, which takes them as they are."""
    q, k, _, positions, _ = _inputs(False, kv_heads=4, dim=12)
    v = jax.random.normal(jax.random.PRNGKey(5), (*k.shape[:3], 8))

    def one_width(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def blockwise(q, k, v):
        return self_attention(q, k, v, Placement(positions), "xla", TILE)

    got = jax.jit(_with_gradients, static_argnums=0)(attention.widened(one_width), q, k, v)
    assert got[0].shape == v.shape[:2] + (q.shape[2], 8)
    for a, b in zip(got, jax.jit(_with_gradients, static_argnums=0)(blockwise, q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_run_reports_the_fallback(tiny_config):
    tiny_config.model.attention.impl = "cudnn"
    run = build(tiny_config)
    assert run.model.spec.attention_impl == "xla"
    assert [n for n in run.notes if n.startswith("warning:")] == [
        "warning: model.attention.impl=cudnn falls back to xla: cuDNN attention needs an NVIDIA GPU (platform is cpu)"]


# Sliding windows and soft-capped logits (Gemma 2/3): every kernel equals a dense reference.

LENGTH, TILE = 64, 16


def _reference(q, k, v, positions, segments, window=0, softcap=0.0):
    """Grouped-query attention as one dense softmax over an explicit [L, S] mask (float32): scores
    scaled, then soft-capped, then masked (causal by position, one document, inside the window)."""
    b, length, h, e = q.shape
    kv = k.shape[2]
    scores = jnp.einsum("bqkge,bske->bkgqs", q.reshape(b, length, kv, h // kv, e), k) * e ** -0.5
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    back = positions[:, :, None] - positions[:, None, :]
    visible = (back >= 0) & (segments[:, :, None] == segments[:, None, :])
    if window:
        visible &= back < window
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgqs,bske->bqkge", probs, v).reshape(q.shape)


def _inputs(documents: bool, length=LENGTH, heads=4, kv_heads=2, dim=8):
    """q, k, v (grouped-query heads), each token's position within its document, segment ids."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, length, heads, dim))
    k = jax.random.normal(keys[1], (2, length, kv_heads, dim))
    v = jax.random.normal(keys[2], (2, length, kv_heads, dim))
    starts = jax.random.bernoulli(keys[3], 2 / length, (2, length)) if documents else jnp.zeros((2, length), bool)
    segments = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    return q, k, v, document_positions(segments), segments


def _with_gradients(f, q, k, v):
    """f(q, k, v) and the gradients of a fixed random projection of it wrt q, k and v."""
    out, pullback = jax.vjp(f, q, k, v)
    return out, *pullback(jax.random.normal(jax.random.PRNGKey(9), out.shape, out.dtype))


def _assert_matches(ours, q, k, v, positions, segments, window, softcap, jit=True):
    def reference(q, k, v):
        return _reference(q, k, v, positions, segments, window, softcap)

    got = (jax.jit(_with_gradients, static_argnums=0) if jit else _with_gradients)(ours, q, k, v)
    for a, b in zip(got, _with_gradients(reference, q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap, documents", [
    (5, 0.0, True),      # narrower than a tile: each query tile visits 2 key tiles
    (23, 0.0, False),    # not a multiple of the tile: 3 key tiles
    (100, 0.0, True),    # longer than the sequence: every tile, the mask alone
    (0, 1.5, False),     # soft-capped, no window
    (16, 1.5, True),     # both, a window of exactly one tile
])
def test_blockwise_window_and_softcap_match_reference(window, softcap, documents):
    """The xla kernel (flash, through self_attention) with grouped-query heads: output and
    gradients equal the dense reference, with packed documents (positions restart) too."""
    q, k, v, positions, segments = _inputs(documents)
    places = Placement(positions, segments if documents else None)

    def ours(q, k, v):
        return self_attention(q, k, v, places, "xla", TILE, window=window, softcap=softcap)

    _assert_matches(ours, q, k, v, positions, segments, window, softcap)


def test_splash_window_and_softcap_match_reference():
    """JAX's Pallas splash kernel (Pallas's interpreter on this host), with its local mask and
    its own soft-cap: two 128-row tiles, packed documents."""
    q, k, v, positions, segments = _inputs(True, length=256)

    def ours(q, k, v):
        return splash.attention(q, k, v, segments, block=128, interpret=True, window=100, softcap=1.5)

    _assert_matches(ours, q, k, v, positions, segments, 100, 1.5, jit=False)


@pytest.mark.parametrize("window, softcap", [(5, 0.0), (0, 1.5), (5, 1.5)])
def test_cached_attention_window_and_softcap_match_reference(window, softcap):
    """Decoding: 3 new tokens per row, at different positions, against a cache of 32 slots (the
    slots after each query hold tokens it must not see) equal those rows of the dense reference."""
    q, k, v, positions, segments = _inputs(False, length=32)
    starts = jnp.array([4, 17])
    rows = starts[:, None] + jnp.arange(3)
    new_q = jnp.take_along_axis(q, rows[:, :, None, None], axis=1)
    got = cached_attention(new_q, k, v, rows, window=window, softcap=softcap)
    want = jnp.take_along_axis(_reference(q, k, v, positions, segments, window, softcap), rows[:, :, None, None], 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_local_layer_s_compiled_attention_grows_with_the_window_not_the_length():
    """Gemma 3's heads (4 query heads to 1 key/value head) at L = 8W (1024 tokens, W = 128, tiles
    of 128): the compiled forward and backward's matmul FLOPs, each loop's body counted once a
    trip (analysis.hlo_stats), are a quarter of global attention's: each query tile visits 2 key
    tiles (its own and the one before, ceil((W - 1) / 128) + 1), not 8, and each key tile 2 query
    tiles in the backward."""
    q = jnp.zeros((1, 1024, 4, 16))
    k = jnp.zeros((1, 1024, 1, 16))
    positions = jnp.broadcast_to(jnp.arange(1024), (1, 1024))

    def flops(window):
        def loss(q, k, v):
            return flash.attention(q, k, v, positions, positions, block=128, window=window).sum()
        return hlo_stats.dot_flops(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text())

    local, full = flops(128), flops(0)
    assert 4 * local == full and local <= full / 3
    assert [flash.band_for(w, 128, 8) for w in (1, 128, 129, 130, 769, 770)] == [1, 2, 2, 3, 7, 0]
