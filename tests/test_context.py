"""Context-parallel attention equals the reference, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_layout
from jaxscale.parallel.context import attention, zigzag_order


def _reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _inputs(heads, kv_heads, length=32, batch=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, dim))
    k = jax.random.normal(keys[1], (batch, length, kv_heads, dim))
    v = jax.random.normal(keys[2], (batch, length, kv_heads, dim))
    return q, k, v


def test_zigzag_pairs_head_and_tail_chunks():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    order = zigzag_order(64, 4)
    assert sorted(order.tolist()) == list(range(64))
    # equal causal work: each shard's positions sum (its count of visible keys) is the same
    work = [(order[i * 16:(i + 1) * 16] + 1).sum() for i in range(4)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("shards, heads, kv_heads", [
    (2, 6, 2), (2, 5, 5),   # grouped-query; odd head count
    (4, 3, 1), (4, 4, 4),   # multi-query with an odd head count; plain multi-head
    (8, 6, 2), (8, 5, 5),
])
def test_matches_reference_forward_and_grads(mode, shards, heads, kv_heads):
    mesh = make_layout(sequence=shards).mesh
    q, k, v = _inputs(heads, kv_heads)
    order = zigzag_order(32, shards)
    positions = jnp.broadcast_to(jnp.asarray(order), (2, 32))

    def ours(q, k, v):  # inputs in zig-zag order, outputs put back in natural order
        out = attention(q[:, order], k[:, order], v[:, order], positions, mesh, mode)
        return out[:, np.argsort(order)]

    cotangent = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * cotangent)

    np.testing.assert_allclose(jax.jit(ours)(q, k, v), _reference(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
