"""The two ends of the vocabulary, split over devices: the token embedding's lookup, and the
output head with its cross entropy. In training neither holds the whole [V, D] table, nor the
head the whole [tokens, V] logits, on any device.

Both run in shard_map over every mesh axis not manual already. The table is stored split along
D over `fsdp` (and `data` under ZeRO-3) and along V over `tensor` (the `vocab` rule):

- lookup (`embed`): each device gathers the token ids of the devices that share its rows' D
  split (all-gather over the axes splitting D; they split the batch too), looks up the rows it
  holds: its slice of D, of its slice of V, other ids masked to zero. The rows are summed over
  the V split (vocab-parallel, as Megatron's) and one all-to-all over the D split gives every
  device its own tokens' whole rows. The gradient goes back the same way and is scatter-added
  into the device's own slice: the table is never gathered, nor its gradient reduced, over D.
- head and loss (`cross_entropy`): over chunks of the device's slice of the vocabulary
  (`model.head_chunk_mib` of float32 logits each), each chunk of the weight is gathered over
  the D split in the compute dtype and multiplied by the device's tokens; a running maximum,
  sum of exponentials and target logit per token (online softmax) are combined over the V split
  at the end. The backward recomputes each chunk's logits (with one chunk, their probabilities
  are kept instead), runs its two matmuls in the compute dtype, and reduce-scatters the chunk's
  weight gradient straight into the shards.

Without a layout (one program; `Strategy()`) both are the plain lookup and head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.kernels.flash import soft_cap, uncap
from jaxscale.models.layers import RESIDUAL
from jaxscale.parallel import fsdp, rings
from jaxscale.parallel.fsdp import Weights
from jaxscale.sharding import Entries, entries, keep, to_spec

IDS = ("batch", "act_length")  # token ids and targets: whole over `tensor`, as the rows they pick
IGNORE = -1  # a target no loss is taken on (a masked token): it matches no column and weighs 0
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Table:
    """A [V, D] table (or the [D, V] head when `transposed`) with its logical names."""

    value: jax.Array
    names: tuple[str, ...]
    transposed: bool = False

    def stored(self, layout) -> Entries:
        """(V axes, D axes) the table is stored split over."""
        dims = layout.stored(self.names, self.value.shape)
        return dims[::-1] if self.transposed else dims


def _index(axes: tuple[str, ...]):
    """This device's place along `axes` (the first the slowest), inside shard_map."""
    index = 0
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def _spec_axes(spec: P, dim: int) -> tuple[str, ...]:
    return entries(spec, dim + 1)[dim]


def _map(layout):
    """(the mesh axes not manual here, the layout as seen inside a map over them)."""
    return layout.free_axes(), layout.here()


def _mapped(local, layout, in_specs, out_specs, check_vma: bool = False):
    """local in shard_map over the mesh axes its specs name (each device its own blocks), or
    called as it is where they name none. Jitted, so that it also runs outside jit."""
    axes = {a for spec in jax.tree.leaves((in_specs, out_specs), is_leaf=lambda x: isinstance(x, P))
            for dims in entries(spec, len(spec)) for a in dims}
    if not axes:
        return local
    return jax.jit(jax.shard_map(local, mesh=layout.mesh_here(), in_specs=in_specs, out_specs=out_specs,
                                 axis_names=axes, check_vma=check_vma))


def _local_rows(table_VD, ids, v_axes):
    """float32 rows of this device's block of the table at `ids` (global ids), zero for ids
    outside its block of V (split over v_axes)."""
    rows = table_VD.shape[0]
    table = table_VD.astype(jnp.float32)
    if not v_axes:
        return jnp.take(table, ids, axis=0)
    local = ids - _index(v_axes) * rows
    inside = (local >= 0) & (local < rows)
    return jnp.where(inside[..., None], jnp.take(table, jnp.where(inside, local, 0), axis=0), 0.0)


def embed(tables: list[tuple[Table, jax.Array]], layout, weights: Weights):
    """x_BLD in the compute dtype: the sum of each table's rows at its ids [B, L] (the token
    table's at the tokens; gpt2's learned positions at the positions), placed as the residual
    stream. The first table is the vocabulary's (split over V as `vocab` says); the others are
    looked up whole over V."""
    compute = weights.compute
    if layout is None:
        return sum(jnp.take(t.value.astype(compute), ids, axis=0) for t, ids in tables)
    axes, here = _map(layout)
    ids_spec, out_spec = here.spec(IDS), here.spec(RESIDUAL)
    vary = set(_spec_axes(ids_spec, 0)) | set(_spec_axes(ids_spec, 1))  # axes the ids differ over
    stored = [keep(t.stored(layout), axes) for t, _ in tables]
    exchange = tuple(a for a in stored[0][1] if a in vary)  # the D split the rows travel over
    scatter = tuple(a for a in _spec_axes(out_spec, 1) if a not in _spec_axes(ids_spec, 1))  # sequence parallel

    def rows_of(block, dims, ids, vocabulary: bool):
        """This device's rows [b * |exchange|, l, D / |exchange|] of one table at the exchange's ids."""
        v_axes, d_axes = dims
        # Whole over the axes the ids differ over along V, and over those they do not along D.
        whole = (tuple(a for a in v_axes if a in vary), tuple(a for a in d_axes if a not in exchange))
        block = fsdp.gather(block, whole, block.dtype.name)
        v_axes = tuple(a for a in v_axes if a not in vary) if vocabulary else ()
        ids = jax.lax.all_gather(ids, exchange, axis=0, tiled=True) if exchange else ids
        return _sum_over(_local_rows(block, ids, v_axes).astype(weights.reduce), v_axes, scatter)

    def local(*args):
        x = sum(rows_of(block, dims, ids, i == 0) for i, (block, dims, ids) in
                enumerate(zip(args[::2], stored, args[1::2])))
        if exchange:
            x = jax.lax.all_to_all(x, exchange, 0, 2, tiled=True)
        return x.astype(compute)

    args, specs = [], []
    for (table, ids), dims in zip(tables, stored):
        args += [table.value.astype(weights.reduce), ids]
        specs += [to_spec(dims[::-1] if table.transposed else dims), ids_spec]
    return _mapped(local, layout, tuple(specs), out_spec, check_vma=True)(*args)


def _sum_over(rows, v_axes, scatter):
    """Rows [b, l, D] summed over the V split; with sequence parallelism (the output's length
    split over `scatter` too) each device keeps its slice of the length: reduce-scattered where
    the V split is over those axes, sliced where it is not."""
    scattered = tuple(a for a in scatter if a in v_axes)
    summed = tuple(a for a in v_axes if a not in scattered)
    if summed:
        rows = jax.lax.psum(rows, summed)
    if scattered:
        rows = jax.lax.psum_scatter(rows, scattered, scatter_dimension=1, tiled=True)
    sliced = tuple(a for a in scatter if a not in scattered)
    if sliced:
        size = rows.shape[1] // math.prod(jax.lax.axis_size(a) for a in sliced)
        rows = jax.lax.dynamic_slice_in_dim(rows, _index(sliced) * size, size, axis=1)
    return rows


@dataclasses.dataclass(frozen=True)
class _Head:
    """The static part of the chunked head inside the map."""

    d_axes: tuple[str, ...]   # the weight's D split: gathered for each chunk
    v_axes: tuple[str, ...]   # the vocabulary split: log-sum-exps combined over it
    columns: int              # this device's vocabulary columns
    chunk: int                # columns per chunk
    chunks: int
    compute: str
    reduce: str
    plan: rings.Stages = ()   # the weight gradient's reduce-scatter over d_axes, in stages
    softcap: float = 0.0      # logits z -> softcap * tanh(z / softcap); 0 = none
    ahead: bool = False       # chunk weights gathered a chunk ahead, gradients reduce-scattered a chunk behind


AHEAD_SHARE = 8  # chunks gathered ahead: a chunk's weight at most 1/8 of model.head_chunk_mib (see chunk_columns)


def chunk_columns(tokens: int, columns: int, mib: float, split: bool = False, ahead_rows: int = 0,
                  itemsize: int = 2) -> int:
    """Vocabulary columns per chunk so that a chunk's float32 logits of `tokens` rows take at
    most `mib` MiB (0: one chunk), a multiple of 128 where it splits; at least two chunks when
    the weight is `split` along D, so that no device gathers the whole of it. With `ahead_rows`
    (the gathered weight's rows, when chunks are gathered ahead: _ahead), a chunk's weight of
    `itemsize` bytes an element also takes at most mib / AHEAD_SHARE MiB: three of them are live
    at once (the chunk in use, the next, the previous one's gradient) where the logits' chunk is one."""
    fit = columns if mib <= 0 else max(128, int(mib * MIB // (4 * max(tokens, 1))) // 128 * 128)
    if split and columns > 1:
        fit = min(fit, -(-columns // 2))
    if ahead_rows and mib > 0:
        fit = min(fit, max(128, int(mib * MIB / AHEAD_SHARE // (itemsize * ahead_rows)) // 128 * 128))
    return min(columns, fit)


def _chunk_weight(w_DV, c, head: _Head):
    """Chunk c of the weight in the compute dtype, gathered over the D split: [D, chunk]."""
    w_chunk = jax.lax.dynamic_slice_in_dim(w_DV, c * head.chunk, head.chunk, axis=1).astype(head.compute)
    return jax.lax.all_gather(w_chunk, head.d_axes, axis=0, tiled=True) if head.d_axes else w_chunk


def _ahead(head: _Head) -> bool:
    """Whether the chunks' weight gathers run a chunk ahead (and their gradients' reduce-scatters
    a chunk behind) of the matmuls: where the weight is split along D over several chunks."""
    return head.ahead and bool(head.d_axes) and head.chunks > 1


def _over_chunks(step, carry, w_DV, head: _Head):
    """scan of step(carry, c, chunk c's weight gathered) -> (carry, y) over the chunks: (carry, the
    ys stacked or None). With _ahead, each chunk's weight is gathered during the previous chunk's
    step, beside its matmuls, not before its own (the last step gathers the first chunk again, for
    nothing: one chunk's bytes more, where running a chunk outside the loop would have XLA keep
    the forward's logits of that chunk for the backward)."""
    def fetch(c):
        return _chunk_weight(w_DV, c, head)

    if not _ahead(head):
        return jax.lax.scan(lambda carry, c: step(carry, c, fetch(c)), carry, jnp.arange(head.chunks))

    def one(state, c):
        carry, w_chunk = state
        upcoming = fetch((c + 1) % head.chunks)
        carry, y = step(carry, c, w_chunk)
        return (carry, upcoming), y

    (carry, _), ys = jax.lax.scan(one, (carry, fetch(0)), jnp.arange(head.chunks))
    return carry, ys


def _chunk_logits(x_TD, w_chunk, c, head: _Head):
    """(float32 logits [T, chunk] of chunk c, soft-capped, the padding columns at -inf; their local
    column numbers)."""
    logits = soft_cap(jnp.einsum("TD,DV->TV", x_TD, w_chunk, preferred_element_type=jnp.float32), head.softcap)
    columns = c * head.chunk + jnp.arange(head.chunk)
    return jnp.where(columns < head.columns, logits, -jnp.inf), columns


def _targets_local(targets_T, head: _Head):
    """The targets as this device's local column numbers (out of range where another device holds them)."""
    return targets_T - _index(head.v_axes) * head.columns if head.v_axes else targets_T


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cross_entropy_sum(x_TD, w_DV, targets_T, mask_T, head: _Head):
    """(sum over this device's tokens of log-sum-exp(x @ W) - (x @ W)[target], sum of
    log-sum-exp(x @ W)^2: the z-loss's), each token's terms times its weight in mask_T (float32;
    None: 1), the vocabulary split over head.v_axes and W's rows over head.d_axes."""
    per_token, lse, _ = _forward(x_TD, w_DV, targets_T, head)
    return _weighted_sum(per_token, mask_T), _weighted_sum(lse * lse, mask_T)


def _weighted_sum(x_T, mask_T):
    return jnp.sum(x_T if mask_T is None else x_T * mask_T)


def _forward(x_TD, w_DV, targets_T, head: _Head):
    """(each token's cross entropy, its log-sum-exp, the probabilities when there is one chunk)."""
    targets = _targets_local(targets_T, head)

    def step(carry, c, w_chunk):
        top, total, picked = carry
        logits, columns = _chunk_logits(x_TD, w_chunk, c, head)
        new_top = jnp.maximum(top, logits.max(-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(-1)
        picked = picked + jnp.where(columns[None] == targets[:, None], logits, 0.0).sum(-1)
        return (new_top, total, picked), logits if head.chunks == 1 and not head.softcap else None

    T = x_TD.shape[0]
    start = (jnp.full((T,), -jnp.inf), jnp.zeros((T,)), jnp.zeros((T,)))
    (top, total, picked), logits = _over_chunks(step, start, w_DV, head)
    if head.v_axes:
        overall = jax.lax.pmax(top, head.v_axes)
        total = jax.lax.psum(total * jnp.exp(top - overall), head.v_axes)
        picked, top = jax.lax.psum(picked, head.v_axes), overall
    lse = top + jnp.log(total)
    probs = jnp.exp(logits[0] - lse[:, None]) if logits is not None else None
    return lse - picked, lse, probs


def _fwd(x_TD, w_DV, targets_T, mask_T, head):
    per_token, lse, probs = _forward(x_TD, w_DV, targets_T, head)
    return ((_weighted_sum(per_token, mask_T), _weighted_sum(lse * lse, mask_T)),
            (x_TD, w_DV, targets_T, mask_T, lse, probs))


def _bwd(head, residuals, cotangents):
    # Inside shard_map without replication checks each device's cotangent is its part of the
    # whole, and the transposes of collectives sum the parts: the sum's cotangent is summed over
    # the vocabulary split (the transpose of the forward's psum), while x's stays this device's
    # part (the map sums it over the vocabulary split, where x enters whole).
    x_TD, w_DV, targets_T, mask_T, lse, probs = residuals
    targets = _targets_local(targets_T, head)
    g, g_z = cotangents
    if head.v_axes:
        g, g_z = jax.lax.psum((g, g_z), head.v_axes)
    # d lse^2 / d logits = 2 lse softmax: the z-loss scales each token's softmax by 1 + 2 lse g_z / g.
    g = jnp.broadcast_to(g, lse.shape) if mask_T is None else g * mask_T  # each token's share
    scale = (g + 2 * g_z * lse * (1.0 if mask_T is None else mask_T))[:, None]

    def grads(dx, c, w_chunk):  # (dx, chunk c's weight gradient, whole over the D split)
        if probs is None:
            logits, columns = _chunk_logits(x_TD, w_chunk, c, head)
            p = jnp.exp(logits - lse[:, None])
        else:
            p, columns = probs, c * head.chunk + jnp.arange(head.chunk)
        d_logits = p * scale - (columns[None] == targets[:, None]) * g[:, None]
        if head.softcap:  # through the cap (padding columns, at -inf, have no gradient to pass)
            d_logits = uncap(d_logits, jnp.where(columns < head.columns, logits, 0.0), head.softcap)
        d_logits = d_logits.astype(head.compute)
        dx = dx + jnp.einsum("TV,DV->TD", d_logits, w_chunk, preferred_element_type=jnp.float32)
        return dx, jnp.einsum("TD,TV->DV", x_TD, d_logits, preferred_element_type=jnp.float32).astype(head.reduce)

    def reduced(dw, c, d_chunk):
        if head.d_axes:
            d_chunk = rings.reduce_scatter(d_chunk, head.d_axes, 0, head.plan)
        return jax.lax.dynamic_update_slice_in_dim(dw, d_chunk, c * head.chunk, axis=1)

    dx, dw = jnp.zeros(x_TD.shape, jnp.float32), jnp.zeros(w_DV.shape, head.reduce)
    if not _ahead(head):
        def step(carry, c, w_chunk):
            dx, d_chunk = grads(carry[0], c, w_chunk)
            return (dx, reduced(carry[1], c, d_chunk)), None
        (dx, dw), _ = _over_chunks(step, (dx, dw), w_DV, head)
    else:  # each chunk's gradient reduce-scattered during the next chunk's matmuls
        def step(carry, c, w_chunk):  # (the first step reduces a zero gradient, into a slot the last one fills)
            dx, dw, pending = carry
            dx, d_chunk = grads(dx, c, w_chunk)
            return (dx, reduced(dw, (c - 1) % head.chunks, pending), d_chunk), None
        nothing = jnp.zeros((x_TD.shape[1], head.chunk), head.reduce)
        (dx, dw, pending), _ = _over_chunks(step, (dx, dw, nothing), w_DV, head)
        dw = reduced(dw, head.chunks - 1, pending)
    return dx.astype(x_TD.dtype), dw.astype(w_DV.dtype), None, None


_cross_entropy_sum.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_cross_entropy(x_TD, w_DV, targets_T, head: _Head):
    """Each of this device's tokens' log-sum-exp(x @ W) - (x @ W)[target], float32 [T]: the pass
    of _cross_entropy_sum with its terms kept apart (a preference loss sums them by row)."""
    return _forward(x_TD, w_DV, targets_T, head)[0]


def _token_fwd(x_TD, w_DV, targets_T, head):
    per_token, lse, probs = _forward(x_TD, w_DV, targets_T, head)
    return per_token, (x_TD, w_DV, targets_T, None, lse, probs)


def _token_bwd(head, residuals, g_T):
    return _bwd(head, residuals, (g_T, jnp.zeros((), jnp.float32)))[:3]  # each token's share: its own cotangent


_token_cross_entropy.defvjp(_token_fwd, _token_bwd)


def _local_loss(x_BLD, w_DV, targets_BL, mask_BL, d_axes, v_axes, columns, weights: Weights, chunk_mib: float,
                plan: rings.Stages = (), cap: float = 0.0, per_token: bool = False, ahead: bool = False):
    """The (weighted: mask_BL, None for 1) sum of this device's tokens' cross entropies (with
    per_token, each one's, [B, L]): its weight block [D/|d_axes|, V/|v_axes|] padded to whole chunks."""
    B, L, D = x_BLD.shape
    chunk = chunk_columns(B * L, columns, chunk_mib, bool(d_axes), D if ahead and d_axes else 0,
                          jnp.dtype(weights.compute).itemsize)
    chunks = -(-columns // chunk)
    w_DV = jnp.pad(w_DV, ((0, 0), (0, chunks * chunk - columns)))
    head = _Head(d_axes, v_axes, columns, chunk, chunks, weights.compute, weights.reduce, plan, cap, ahead)
    x_TD, targets_T = x_BLD.reshape(B * L, D).astype(weights.compute), targets_BL.reshape(-1)
    if per_token:
        return _token_cross_entropy(x_TD, w_DV, targets_T, head).reshape(B, L)
    mask_T = None if mask_BL is None else mask_BL.reshape(-1).astype(jnp.float32)
    return _cross_entropy_sum(x_TD, w_DV, targets_T, mask_T, head)


def cross_entropy(x_BLD, head: Table, targets_BL, layout, weights: Weights, chunk_mib: float, prelude=None,
                  cap: float = 0.0, mask_BL=None, count=None, per_token: bool = False, ahead: bool = False):
    """(mean next-token cross entropy of the logits x @ head, mean squared log-sum-exp of the
    logits: the z-loss), over the vocabulary, float32 throughout, the logits in chunks, each
    soft-capped at `cap` (0: not); with mask_BL (0/1 per token, placed as the tokens) the means
    over the tokens it keeps. With `count` (a float32 scalar) targets may be IGNORE, which weigh
    0, and both sums are divided by count instead of by the tokens they weigh (step.trained: a
    piece of a batch divides by its share of the whole batch's trained tokens). x_BLD is placed as
    the residual stream; prelude(x) -> x, if given, runs on it first (the final norm: inside the
    map, so its weights are gathered here) and is (fn, params, stored dims of params). With
    per_token, each token's cross entropy instead, float32 [B, L] placed as the tokens (mask_BL
    and count are not taken; an IGNORE target's is its log-sum-exp)."""
    if count is not None:
        kept = (targets_BL != IGNORE).astype(jnp.float32)
        mask_BL = kept if mask_BL is None else mask_BL * kept
    if layout is None:
        x_BLD = prelude[0](prelude[1], x_BLD) if prelude else x_BLD
        w_DV = head.value.T if not head.transposed else head.value
        sums = _local_loss(x_BLD, w_DV, targets_BL, mask_BL, (), (), w_DV.shape[1], weights, chunk_mib, cap=cap,
                           per_token=per_token)
        if per_token:
            return sums
        if count is None:
            count = targets_BL.size if mask_BL is None else jnp.sum(mask_BL.astype(jnp.float32))
        return tuple(total / count for total in sums)
    axes, here = _map(layout)
    x_spec, ids_spec = here.spec(RESIDUAL), here.spec(IDS)
    gather_length = tuple(a for a in _spec_axes(x_spec, 1) if a not in _spec_axes(ids_spec, 1))
    rows = set(_spec_axes(ids_spec, 0)) | set(_spec_axes(ids_spec, 1))  # axes the tokens differ over
    v_all, d_axes = keep(head.stored(layout), axes)
    v_gather = tuple(a for a in v_all if a in rows)
    v_axes = tuple(a for a in v_all if a not in rows)
    vocab = head.value.shape[1 if head.transposed else 0]
    columns = vocab // math.prod(layout.mesh.shape[a] for a in v_axes)
    fn, params, dims = prelude or (None, {}, {})

    def local(x_BLD, w, targets_BL, params, mask_BL, given):
        if fn is not None:
            x_BLD = fn(jax.tree.map(lambda p, d: fsdp.gather(p, keep(d.split, axes), weights.compute), params, dims),
                       x_BLD)
        if gather_length:
            x_BLD = jax.lax.all_gather(x_BLD, gather_length, axis=1, tiled=True)
        w_DV = w if head.transposed else w.T
        if v_gather:
            w_DV = jax.lax.all_gather(w_DV, v_gather, axis=1, tiled=True)
        sums = _local_loss(x_BLD, w_DV, targets_BL, mask_BL, d_axes, v_axes, columns, weights, chunk_mib,
                           rings.stages(layout.mesh, d_axes), cap, per_token, ahead)
        if per_token:
            return sums
        if given is not None:
            count = given
        elif mask_BL is None:
            count = targets_BL.size * math.prod(jax.lax.axis_size(a) for a in rows)
        else:
            count = jnp.sum(mask_BL.astype(jnp.float32))
            count = jax.lax.psum(count, tuple(sorted(rows))) if rows else count
        sums = jax.lax.psum(sums, tuple(sorted(rows))) if rows else sums
        return tuple(total / count for total in sums)

    w_dims = keep(head.stored(layout), axes)
    w_spec = to_spec(w_dims[::-1] if head.transposed else w_dims)
    p_specs = jax.tree.map(lambda _, d: to_spec(keep(d.split, axes)), params, dims)
    inward = jax.tree.map(lambda p: p.astype(weights.reduce), (head.value, params))
    return _mapped(local, layout, (x_spec, w_spec, ids_spec, p_specs, None if mask_BL is None else ids_spec,
                            None if count is None else P()),
                   ids_spec if per_token else (P(), P()))(x_BLD, inward[0], targets_BL, inward[1], mask_BL, count)

