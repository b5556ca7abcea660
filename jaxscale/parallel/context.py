"""Context parallelism: attention over a sequence split across the `sequence` mesh axis.

Two strategies, both inside shard_map over `sequence` (other mesh axes stay automatic):
- ring: K/V blocks travel around the ring with ppermute while each device folds them into an
  online (log-sum-exp) softmax; memory per device grows with (L/S)^2 per step, never L^2.
- all_gather: each device gathers the whole K/V once and attends its queries to it; fewer,
  larger messages, better for short sequences.

Causality comes from the tokens' true positions. Both expect the zig-zag layout
(`zigzag_order`), which gives every device an equal share of unmasked work; the ring uses it to
compute only the visible half of each visiting block. Gradients
come from autodiff through the loop (the running max is a stop_gradient: the result does not
depend on it mathematically).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxscale.errors import require, require_choice
from jaxscale.names import CONTEXT_PARALLEL
from jaxscale.parallel import batch_axes, current_mesh

AXIS = "sequence"


def check(config, sizes) -> None:
    """A known strategy, and with the sequence split (`sizes[AXIS]` > 1) a train.seq_len that the
    zig-zag layout cuts into 2 x sizes[AXIS] equal chunks; raises ConfigError naming the field."""
    require_choice("model.attention.context_parallel", config.model.attention.context_parallel, CONTEXT_PARALLEL)
    chunks, seq_len = 2 * sizes[AXIS], config.train.seq_len
    require(sizes[AXIS] == 1 or seq_len % chunks == 0, "train.seq_len", seq_len,
            f"context parallelism lays the sequence out in {chunks} chunks (2 x mesh.sequence); "
            f"use a multiple of {chunks}")
_MASKED = -1e30  # finite, so fully masked rows stay NaN-free


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Token order that gives shard i chunks i and 2S-1-i of 2S equal chunks (head-tail pairing).

    Under a causal mask an early chunk has little work and a late chunk much; pairing them
    evens out the unmasked work per shard.
    """
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _group(q_BQHE, kv_heads: int):
    b, q, h, e = q_BQHE.shape
    return q_BQHE.reshape(b, q, kv_heads, h // kv_heads, e)


def _block(carry, q_BQKGE, k_BSKE, v_BSKE, q_pos_BQ, k_pos_BS):
    """Fold one K/V block into the running (out, max, sum) of an online softmax, in fp32."""
    out, run_max, run_sum = carry
    scale = q_BQKGE.shape[-1] ** -0.5
    s = jnp.einsum("bqkge,bske->bkgqs", q_BQKGE, k_BSKE, preferred_element_type=jnp.float32) * scale
    visible = (q_pos_BQ[:, None, None, :, None] >= k_pos_BS[:, None, None, None, :])
    s = jnp.where(visible, s, _MASKED)
    new_max = jax.lax.stop_gradient(jnp.maximum(run_max, s.max(-1)))
    p = jnp.exp(s - new_max[..., None]) * visible
    correction = jnp.exp(run_max - new_max)
    run_sum = run_sum * correction + p.sum(-1)
    pv = jnp.einsum("bkgqs,bske->bqkge", p.astype(v_BSKE.dtype), v_BSKE, preferred_element_type=jnp.float32)
    out = out * jnp.moveaxis(correction, -1, 1)[..., None] + pv
    return out, new_max, run_sum


def _start(q_BQKGE):
    b, q, k, g, e = q_BQKGE.shape
    return (jnp.zeros((b, q, k, g, e), jnp.float32), jnp.full((b, k, g, q), _MASKED, jnp.float32),
            jnp.zeros((b, k, g, q), jnp.float32))


def _finish(carry, q_BQHE):
    out, _, run_sum = carry
    out = out / jnp.moveaxis(run_sum, -1, 1)[..., None]
    return out.reshape(q_BQHE.shape).astype(q_BQHE.dtype)


def _split_rows(carry, half: int):
    out, run_max, run_sum = carry
    return ((out[:, :half], run_max[..., :half], run_sum[..., :half]),
            (out[:, half:], run_max[..., half:], run_sum[..., half:]))


def _join_rows(head, tail):
    return (jnp.concatenate([head[0], tail[0]], 1), jnp.concatenate([head[1], tail[1]], -1),
            jnp.concatenate([head[2], tail[2]], -1))


def _visiting_block(carry, q, k, v, q_pos, k_pos, from_earlier_shard):
    """A K/V block from another shard, zig-zag layout: exactly half of it is visible, so compute half.

    Shard i holds chunks (i, 2S-1-i). K/V from an earlier shard j < i: its first chunk j is
    visible to all our queries and its second chunk (2S-1-j) to none. From a later shard j > i:
    only our second chunk sees it, and sees all of it.
    """
    half = q.shape[1] // 2

    def earlier(carry):
        return _block(carry, q, k[:, :half], v[:, :half], q_pos, k_pos[:, :half])

    def later(carry):
        head, tail = _split_rows(carry, half)
        return _join_rows(head, _block(tail, q[:, half:], k, v, q_pos[:, half:], k_pos))

    return jax.lax.cond(from_earlier_shard, earlier, later, carry)


def _ring_local(q_BQHE, k_BSKE, v_BSKE, q_pos_BQ, k_pos_BS, *, shards: int):
    """Ring attention for inputs in zig-zag order (see zigzag_order): S-1 K/V hops."""
    q = _group(q_BQHE, k_BSKE.shape[2])
    me = jax.lax.axis_index(AXIS)
    shift = [(i, (i + 1) % shards) for i in range(shards)]

    def step(state, hop):
        carry, k, v, k_pos = state
        k, v, k_pos = (jax.lax.ppermute(x, AXIS, shift) for x in (k, v, k_pos))
        source = (me - hop) % shards
        return (_visiting_block(carry, q, k, v, q_pos_BQ, k_pos, source < me), k, v, k_pos), None

    diagonal = _block(_start(q), q, k_BSKE, v_BSKE, q_pos_BQ, k_pos_BS)  # our own chunks, causal
    (carry, *_), _ = jax.lax.scan(step, (diagonal, k_BSKE, v_BSKE, k_pos_BS), jnp.arange(1, shards))
    return _finish(carry, q_BQHE)


def _all_gather_local(q_BQHE, k_BSKE, v_BSKE, q_pos_BQ, k_pos_BS):
    k, v, k_pos = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k_BSKE, v_BSKE, k_pos_BS))
    q = _group(q_BQHE, k.shape[2])
    return _finish(_block(_start(q), q, k, v, q_pos_BQ, k_pos), q_BQHE)


def attention(q_BLHE, k_BLKE, v_BLKE, positions_BL, mesh, mode: str = "ring"):
    """Causal attention with the length dimension split over `sequence` (ring or all_gather).

    The batch's own split (the active layout's `batch` axes) is manual too: left automatic, the
    partitioner gathered the whole batch over `data` for an all-gather inside the map (every
    data replica then attended to every row; measured on XLA:CPU and the TPU compiler)."""
    shards = mesh.shape[AXIS]
    local = (functools.partial(_ring_local, shards=shards) if mode == "ring" else _all_gather_local)
    batch = batch_axes(AXIS)
    seq = P(batch or None, AXIS)
    return jax.shard_map(local, mesh=current_mesh(mesh), in_specs=(seq, seq, seq, seq, seq), out_specs=seq,
                         axis_names={AXIS, *batch}, check_vma=False)(q_BLHE, k_BLKE, v_BLKE, positions_BL, positions_BL)
