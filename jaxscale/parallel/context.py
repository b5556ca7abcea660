"""Context parallelism: attention over a sequence split across the `sequence` mesh axis.

Three strategies, all inside shard_map over `sequence` (the batch's mesh axes manual too), all
on the blockwise attention of `kernels.flash`:
- ring: key/value blocks travel around the ring with ppermute while each device folds them into
  its queries' online softmax, each send issued beside the current block's compute so the two
  overlap. Its own backward (custom_vjp, as Liu et al.'s ring attention) saves only the output
  and the log-sum-exp and makes a second ring pass, the dK/dV sums following the blocks one hop
  behind: memory per device O(L/S · d), never a score matrix.
- all_gather: each device gathers the whole K/V once and attends its queries to it (gradients
  reduce-scattered back); fewer, larger messages, better for short sequences.
- ulysses (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a split of the heads,
  each device attends the whole sequence with its share of the heads, and a second all-to-all
  turns the output back: four all-to-alls of a layer's activations forward and four backward,
  whose bytes do not grow with the number of devices; the heads a device holds (after `tensor`)
  must divide by `sequence`. The whole row is put back in token order for the kernel, so sliding
  windows and soft-capped scores work as on one device.

Causality comes from the tokens' true positions, document boundaries from segment ids. All
expect the zig-zag layout (`zigzag_order`), which gives every device an equal share of unmasked
work; with tiles no longer than a chunk, the blockwise kernel skips the tiles no query of the
device can see, so a visiting block costs half a diagonal one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxscale.errors import require, require_choice
from jaxscale.kernels import flash
from jaxscale.names import CONTEXT_PARALLEL
from jaxscale.sharding import manual_here

AXIS = "sequence"


def check(config, sizes) -> None:
    """A known strategy, and with the sequence split (`sizes[AXIS]` > 1) a train.seq_len that the
    zig-zag layout cuts into 2 x sizes[AXIS] equal chunks, and for ulysses heads a device holds that
    divide by it; raises ConfigError naming the field."""
    mode = config.model.attention.context_parallel
    require_choice("model.attention.context_parallel", mode, CONTEXT_PARALLEL)
    chunks, seq_len = 2 * sizes[AXIS], config.train.seq_len
    require(sizes[AXIS] == 1 or seq_len % chunks == 0, "train.seq_len", seq_len,
            f"context parallelism lays the sequence out in {chunks} chunks (2 x mesh.sequence); "
            f"use a multiple of {chunks}")
    heads = config.model.num_heads // sizes["tensor"]
    require(sizes[AXIS] == 1 or mode != "ulysses" or heads % sizes[AXIS] == 0, "model.attention.context_parallel",
            mode, f"ulysses splits each device's {heads} heads (model.num_heads / mesh.tensor) over mesh.sequence="
                  f"{sizes[AXIS]}; use a mesh.sequence that divides them, or ring or all_gather")


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Token order that gives shard i chunks i and 2S-1-i of 2S equal chunks (head-tail pairing).

    Under a causal mask an early chunk has little work and a late chunk much; pairing them
    evens out the unmasked work per shard.
    """
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _send(x, shards: int):
    """x from each device to the next one around the ring."""
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % shards) for i in range(shards)])


def _ring_hops(hop, carry, shards: int):
    """Run hop(carry, send) for each of the ring's `shards` blocks: every hop but the last also
    sends the visiting block on (send=True), the middle ones in a scan."""
    carry = hop(carry, True)
    carry, _ = jax.lax.scan(lambda c, _: (hop(c, True), None), carry, length=shards - 2)
    return hop(carry, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, pos, seg, shards: int, block: int):
    return _ring_fwd(q, k, v, pos, seg, shards, block)[0]


def _ring_fwd(q, k, v, pos, seg, shards, block):
    """Each device folds the S key/value blocks into its queries' result as they come round;
    the send of the next block is issued beside the current block's compute (it depends only on
    the block, not on the result), so the two can overlap."""
    def hop(carry, send):
        out, lse, visiting = carry
        following = jax.tree.map(functools.partial(_send, shards=shards), visiting) if send else None
        k_h, v_h, pos_h, seg_h = visiting
        out, lse = flash.merge(out, lse, *flash.forward(q, k_h, v_h, pos, pos_h, seg, seg_h, block, block))
        return out, lse, following

    empty = (jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32), jnp.full(q.shape[:-1], flash.EMPTY, jnp.float32))
    out, lse, _ = _ring_hops(hop, (*empty, (k, v, pos, seg)), shards)
    out = out.astype(q.dtype)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(shards, block, residuals, d_out):
    """The second ring pass: keys and values go round again, each followed one hop behind by the
    running sum of its dK and dV (float32), which each device adds its queries' share to. The sum
    a device receives is needed only after its own share is computed, so that send overlaps the
    compute too. After S hops the sums are one hop short of home: one last send."""
    q, k, v, pos, seg, out, lse = residuals
    row_delta = flash.delta(out, d_out)

    def hop(carry, send):
        dq, visiting, sums = carry
        following = jax.tree.map(functools.partial(_send, shards=shards), visiting) if send else None
        arrived = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)) if sums is None else \
            jax.tree.map(functools.partial(_send, shards=shards), sums)
        k_h, v_h, pos_h, seg_h = visiting
        dq, *sums = flash.backward(q, k_h, v_h, pos, pos_h, seg, seg_h, lse, row_delta, d_out, block, block,
                                   into=(dq, *arrived))
        return dq, following, tuple(sums)

    dq, _, sums = _ring_hops(hop, (jnp.zeros(q.shape, jnp.float32), (k, v, pos, seg), None), shards)
    dk, dv = jax.tree.map(functools.partial(_send, shards=shards), sums)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_local(q_BQHE, k_BSKE, v_BSKE, pos_BQ, seg_BQ, *, shards: int, block: int):
    q, k, v = flash.group(q_BQHE, k_BSKE.shape[2]), flash.heads_major(k_BSKE), flash.heads_major(v_BSKE)
    return flash.ungroup(_ring(q, k, v, pos_BQ, seg_BQ, shards, block))


def _all_gather_local(q_BQHE, k_BSKE, v_BSKE, pos_BQ, seg_BQ, *, shards: int, block: int):
    k, v, k_pos, k_seg = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k_BSKE, v_BSKE, pos_BQ, seg_BQ))
    return flash.attention(q_BQHE, k, v, pos_BQ, k_pos, seg_BQ, k_seg, block)


def _ulysses_local(q_BQHE, k_BSKE, v_BSKE, pos_BQ, seg_BQ, *, shards: int, block: int, window: int = 0,
                   softcap: float = 0.0):
    """Each device's rows of the length, all heads -> the whole length, its heads (all-to-all);
    attention in token order; back. Key/value heads too few to split are repeated to one per
    query head first, so each device holds the ones its query heads read."""
    heads, kv_heads = q_BQHE.shape[2], k_BSKE.shape[2]
    if kv_heads % shards:
        k_BSKE, v_BSKE = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k_BSKE, v_BSKE))
    q, k, v = (jax.lax.all_to_all(x, AXIS, 2, 1, tiled=True) for x in (q_BQHE, k_BSKE, v_BSKE))
    pos, seg = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (pos_BQ, seg_BQ))
    zigzag = zigzag_order(q.shape[1], shards)  # the order the devices' chunks arrive in
    natural = np.argsort(zigzag)
    q, k, v, pos, seg = (jnp.take(x, natural, axis=1) for x in (q, k, v, pos, seg))
    out = flash.attention(q, k, v, pos, pos, seg, seg, block, window, softcap)
    return jax.lax.all_to_all(jnp.take(out, zigzag, axis=1), AXIS, 1, 2, tiled=True)


LOCAL = {"ring": _ring_local, "all_gather": _all_gather_local, "ulysses": _ulysses_local}


def attention(q_BLHE, k_BLKE, v_BLKE, positions_BL, segments_BL, layout, mode: str = "ring", block: int = flash.BLOCK,
              window: int = 0, softcap: float = 0.0):
    """Causal attention with the length dimension split over `sequence` (ring, all_gather or
    ulysses), in tiles of at most `block` rows that divide each zig-zag chunk (so the tiles a
    device cannot see are skipped whole); segments_BL (None: one document a row) keeps each token
    within its document; `window` and `softcap` (ulysses only; the config checks refuse them
    beside the others) as in `flash.attention`.

    The batch's own split (`layout`'s `batch` axes) is manual too: left automatic, the
    partitioner gathered the whole batch over `data` for an all-gather inside the map (every
    data replica then attended to every row; measured on XLA:CPU and the TPU compiler)."""
    mesh = layout.mesh
    shards = mesh.shape[AXIS]
    segments_BL = jnp.zeros_like(positions_BL) if segments_BL is None else segments_BL
    tile = flash.block_for(q_BLHE.shape[1] // (2 * shards), block)
    masks = dict(window=window, softcap=softcap) if mode == "ulysses" else {}
    local = functools.partial(LOCAL[mode], shards=shards, block=tile, **masks)
    if AXIS in manual_here():  # in a layer's map over the rows and the length
        return local(q_BLHE, k_BLKE, v_BLKE, positions_BL, segments_BL)
    batch = layout.batch_axes(AXIS)
    seq = P(batch or None, AXIS)
    return jax.shard_map(local, mesh=layout.mesh_here(), in_specs=(seq,) * 5, out_specs=seq,
                         axis_names={AXIS, *batch}, check_vma=False)(q_BLHE, k_BLKE, v_BLKE, positions_BL, segments_BL)
