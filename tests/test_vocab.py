"""The vocabulary's ends (models/vocab.py): the chunked head and cross entropy against optax on
whole float32 logits, with gradients and the z-loss; on a layout, against one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import make_layout
from jaxscale.models import LanguageModel, ModelSpec, Strategy
from jaxscale.models.vocab import Table, chunk_columns, cross_entropy
from jaxscale.parallel.fsdp import Weights
from jaxscale.sharding import Layout

T, D, V = 96, 32, 448  # tokens, d_model, vocabulary


def _inputs(seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(keys[0], (2, T // 2, D))
    w = 0.5 * jax.random.normal(keys[1], (D, V))
    targets = jax.random.randint(keys[2], (2, T // 2), 0, V)
    return x, w, targets


def _reference(x, w_DV, targets, z):
    """optax's cross entropy on whole float32 logits, plus z x mean(logsumexp^2)."""
    logits = jnp.einsum("BLD,DV->BLV", x.astype(jnp.float32), w_DV.astype(jnp.float32))
    lse = jax.nn.logsumexp(logits, axis=-1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() + z * jnp.mean(lse ** 2)


def _fused(x, w_DV, targets, z, tied, chunk_mib, dtype=jnp.float32):
    head = Table(w_DV.T, ("vocab", "embed")) if tied else Table(w_DV, ("embed", "vocab"), transposed=True)
    loss, z_loss = cross_entropy(x, head, targets, None, Weights.of(dtype), chunk_mib)
    return loss + z * z_loss


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_mib", [0.0, 0.05])  # one chunk (probabilities kept), or 4 chunks of 128 columns
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_the_chunked_loss_equals_optax_with_gradients(tied, chunk_mib, z):
    x, w, targets = _inputs()
    assert chunk_columns(T, V, chunk_mib) == (V if chunk_mib == 0 else 128)
    want, want_grads = jax.value_and_grad(_reference, argnums=(0, 1))(x, w, targets, z)
    got, got_grads = jax.value_and_grad(_fused, argnums=(0, 1))(x, w, targets, z, tied, chunk_mib)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_in_bfloat16_the_loss_and_gradients_keep_bfloat16_accuracy():
    """bfloat16 operands, float32 accumulation and log-sum-exp: the loss within bf16's rounding of
    the inputs, the gradients to a few bf16 ulps, of float32's on the same rounded inputs."""
    x, w, targets = _inputs(1)
    x16, w16 = x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    want, want_grads = jax.value_and_grad(_reference, argnums=(0, 1))(x16, w16, targets, 1e-2)
    got, got_grads = jax.value_and_grad(_fused, argnums=(0, 1))(x, w, targets, 1e-2, False, 0.05, jnp.bfloat16)
    np.testing.assert_allclose(got, want, rtol=1e-3)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=3e-2, atol=3e-2 * float(jnp.abs(r).max()))


@pytest.mark.parametrize("sizes", [None, dict(data=2, fsdp=2, tensor=2)], ids=["one_device", "data_fsdp_tensor"])
def test_a_mask_keeps_its_tokens_loss_and_gradients(sizes):
    """With a 0/1 mask per token, the loss and z-loss are the means over the tokens it keeps (optax
    on whole logits, masked), their gradients too; in 4 chunks of the vocabulary, on one device
    or with the head split over fsdp and tensor and the tokens over data and fsdp."""
    x, w, targets = _inputs(2)
    x, targets = x.reshape(4, T // 4, D), targets.reshape(4, T // 4)  # rows over data x fsdp
    mask = (jax.random.uniform(jax.random.PRNGKey(3), targets.shape) < 0.6).astype(jnp.float32)
    layout = None if sizes is None else make_layout(**sizes)

    def reference(x, w):
        logits = jnp.einsum("BLD,DV->BLV", x, w)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return (jnp.sum(ce * mask) + 1e-2 * jnp.sum(lse ** 2 * mask)) / jnp.sum(mask)

    def fused(x, w):
        loss, z_loss = cross_entropy(x, Table(w.T, ("vocab", "embed")), targets, layout, Weights(), 0.05, mask_BL=mask)
        return loss + 1e-2 * z_loss

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(x, w)
    got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


SPEC = ModelSpec(num_layers=2, d_model=64, num_heads=4, num_kv_heads=4, d_ff=128, vocab_size=V,
                 tie_embeddings=False, z_loss_weight=1e-2, head_chunk_mib=0.05)


def _objective(model, params, tokens):
    return model.loss(params, tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("sizes", [dict(fsdp=8), dict(data=2, tensor=4)], ids=["fsdp8", "data2_tensor4"])
def test_the_model_s_loss_and_z_loss_equal_one_device_and_its_logits(sizes):
    """The objective is the cross entropy plus z-loss of the model's own logits; split over fsdp
    (the head gathered chunk by chunk) or tensor (the vocabulary split), the same numbers."""
    one = LanguageModel(SPEC)
    params = one.init(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 33), 0, V)
    objective, metrics = _objective(one, params, tokens)
    logits = one.apply(params, tokens[:, :-1])
    lse = jax.nn.logsumexp(logits, -1)
    np.testing.assert_allclose(metrics["loss"], optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["z_loss"], jnp.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(objective, metrics["loss"] + 1e-2 * metrics["z_loss"], rtol=1e-6)

    layout: Layout = make_layout(**sizes)
    split = LanguageModel(dataclasses.replace(SPEC, strategy=Strategy.for_layout(layout)))

    def grads(model, params):
        return jax.grad(lambda p: _objective(model, p, tokens)[0])(params)

    want = grads(one, params)
    got = jax.jit(lambda p: grads(split, p))(params)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6), got, want)
