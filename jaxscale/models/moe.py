"""Mixture-of-experts MLP: a top-k router (softmax, or DeepSeek-V3's sigmoid with group-limited
selection), expert capacity or dropless grouped matmuls, and expert parallelism.

Routing groups are sequences: each row of the batch routes its own L tokens, and each expert
takes at most C = min(L, ceil(capacity_factor * L * top_k / num_experts)) of a row's
assignments; the rest are dropped (the token keeps only its residual for that choice). Within a
row every token's first choice queues before any second choice (GShard), and earlier tokens
before later ones. Dropless (capacity_factor 0) drops nothing: each device sorts its
assignments by expert and runs the experts as grouped matmuls (`lax.ragged_dot`), no buffer
padded to a capacity; over `expert` the sorted rows travel to their experts' devices and back
by ragged all-to-all (parallel.ragged). Balancing
without an auxiliary loss (bias_rate > 0, DeepSeek-V3): a per-expert bias, added to the router's
scores only to choose the experts, moves after each step towards an even load (`balance`).
The load-balancing loss is computed per row and averaged over rows, so
routing, drops and losses are the same however the batch is split over devices or microbatches.

Expert parallelism: expert weights are split over the `expert` mesh axis, and so is the batch
(outside MoE layers `expert` is one more batch axis). The router runs on the whole batch as any
layer does. Dispatch and combine run in `shard_map` over the batch axes (`expert` and, where
they split the batch, `data` and `fsdp`): each device scatters its own rows' tokens into a
[rows, experts, C, D] buffer, one all-to-all over `expert` sends every expert's slots to the
device holding that expert, the local experts run, and a second all-to-all brings the results
back to be combined with the router's weights (dropless: the sorted rows, no slots, both ways).
Expert weights split over `fsdp` are gathered inside (their gradients reduce-scattered back, as
FSDP does); `tensor` stays automatic and splits the experts' hidden dimension. (All-to-alls
are manual over every batch axis because XLA gathers an operand's automatic dimensions before
an all-to-all in a partly manual region.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.models.layers import MLP, MLPS, MLPKind, normal, zeros
from jaxscale.models.strategy import Strategy
from jaxscale.parallel import context, fsdp, ragged
from jaxscale.sharding import constrain, entries, manual_here, to_spec

AXIS = "expert"
STATS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")  # per-step metrics, means over the MoE layers
LOAD = "moe_load"  # a layer's share of the assignments per expert [X] (the model reports its max)
MAX_LOAD = "moe_max_load"  # mean over MoE layers of the busiest expert's share x num_experts (1 = even)
EXPERT_LOAD = "moe_expert_load"  # [X]: each expert's share x num_experts, mean over MoE layers (1 = even)
BIAS_PATH = "['layers']['moe']['mlp']['bias_balance']"  # the selection biases in the parameters
# Logical axes of the expert weights, of every MLP kind (layers.MLPS), with and without biases.
_IN, _OUT = {name for kind in MLPS.values() for name in kind.inputs}, {kind.output for kind in MLPS.values()}
EXPERT_AXES = {**{f"w_{n}": ("experts", "embed", "mlp") for n in _IN},
               **{f"bias_{n}": ("experts", "mlp") for n in _IN},
               **{f"w_{n}": ("experts", "mlp", "embed") for n in _OUT},
               **{f"bias_{n}": ("experts", "embed") for n in _OUT}}


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """config.model.moe: num_experts 0 is a dense model."""

    num_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    every_n_layers: int = 1     # layer i (from 1, after the first_dense) is MoE when i % every_n_layers == 0
    first_dense: int = 0        # dense layers before the others (DeepSeek-V3's first_k_dense_replace)
    d_ff: int = 0               # expert hidden size; 0 = model.d_ff
    num_shared: int = 0         # shared experts every token goes through (one MLP of num_shared x d_ff)
    bias_rate: float = 0.0      # auxiliary-loss-free balancing: the selection bias's step per update
    selection_bias: bool = False  # a per-expert bias on the selection scores even when bias_rate is 0
                                  # (an imported DeepSeek-V3's e_score_correction_bias, kept as trained)
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    score: str = "softmax"      # softmax | sigmoid (DeepSeek-V3: each logit on its own), in float32
    renormalize: bool = True    # top_k > 1: the chosen scores divided by their sum (HF's norm_topk_prob)
    expert_groups: int = 1      # DeepSeek's group-limited routing (HF n_group): consecutive groups of experts
    top_groups: int = 1         # ... of which a token may choose only in its top_groups best (HF topk_group)
    routed_scale: float = 1.0   # combine weights x this (HF routed_scaling_factor; DeepSeek-V3: 2.5)
    hidden_chunk: int = 0       # dropless: the experts' hidden activations in slices of at most this
                                # many columns (grouped_mlp); 0 = whole

    @property
    def biased(self) -> bool:
        """Whether the MoE layers hold a selection bias (`bias_balance`)."""
        return self.selection_bias or self.bias_rate > 0

    def moe_layers(self, num_layers: int) -> int:
        """How many of a model's `num_layers` layers are MoE layers."""
        return (num_layers - self.first_dense) // self.every_n_layers

    def router(self) -> dict:
        """`route`'s scoring and selection options."""
        return dict(score=self.score, renormalize=self.renormalize, expert_groups=self.expert_groups,
                    top_groups=self.top_groups, routed_scale=self.routed_scale)


def capacity(length: int, spec: MoESpec) -> int:
    """Slots per expert per row of `length` tokens (dropless, capacity_factor 0: all `length`,
    which no expert can overflow, as a token picks an expert at most once)."""
    if spec.capacity_factor == 0:
        return length
    return min(length, math.ceil(spec.capacity_factor * length * spec.top_k / spec.num_experts))


class Routing(NamedTuple):
    """Where a [B, L] batch of tokens goes: k choices per token."""

    experts: jax.Array    # int32 [B, L, k]: chosen experts, most probable first
    positions: jax.Array  # int32 [B, L, k]: place in the chosen expert's queue of that row
    weights: jax.Array    # float32 [B, L, k]: combine weights, 0 where dropped
    keep: jax.Array       # bool [B, L, k]: the assignment fits within capacity
    counts: jax.Array     # int32 [B, X]: assignments per expert and row, before dropping
    aux_loss: jax.Array   # load balancing: mean over rows of X * sum_e fraction_e * mean_score_e
    z_loss: jax.Array     # mean over tokens of logsumexp(logits)^2
    dropped: jax.Array    # fraction of assignments dropped


def route(logits_BLX, top_k: int, capacity_per_row: int, order: np.ndarray | None = None,
          bias_X=None, *, score: str = "softmax", renormalize: bool = True, expert_groups: int = 1,
          top_groups: int = 1, routed_scale: float = 1.0) -> Routing:
    """Top-k routing with per-row capacity, in float32. Queues fill in token order: with the
    tokens laid out in another (`order`: place i holds token order[i], the zig-zag layout of
    context parallelism), places are counted in token order all the same, so the same tokens are
    dropped in any layout.

    Scores: softmax over the experts, or (`score`="sigmoid", DeepSeek-V3) the sigmoid of each
    logit on its own. Selection scores are the scores plus `bias_X` (auxiliary-loss-free
    balancing, DeepSeek-V3; no gradient flows through it), which only chooses the experts. With
    `expert_groups` G > 1 (DeepSeek's group-limited routing, HF n_group/topk_group) the experts
    form G consecutive groups of equal size, each group scores the sum of its two best selection
    scores, and a token chooses only among the experts of its `top_groups` best groups. Combine
    weights are the chosen experts' (un-biased) scores, divided by their sum when top_k > 1 and
    `renormalize` (GShard, Mixtral; HF norm_topk_prob); with top_k = 1 the raw score (Switch), so
    the router still learns from the main loss; then times `routed_scale` (HF
    routed_scaling_factor). Experts are chosen by argmaxes, ties to the lower index.

    The load-balancing loss is X * sum_e fraction_e * mean_score_e per row, where mean_score_e
    is the mean over the row's tokens of the softmax probability, or, with sigmoid scores, of
    the scores normalised to sum to 1 per token (DeepSeek-V3's sequence-wise balance loss). The
    z-loss is the mean of logsumexp(logits)^2 either way.
    """
    logits = logits_BLX.astype(jnp.float32)
    B, L, X = logits.shape
    if score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        mean_of = scores / scores.sum(-1, keepdims=True)  # what the balancing loss averages
    else:
        scores = mean_of = jax.nn.softmax(logits, axis=-1)
    limited = top_groups < expert_groups
    if bias_X is None and not limited:
        top_p, experts = _top_k(scores, top_k)
    else:
        choice = scores if bias_X is None else scores + jax.lax.stop_gradient(bias_X.astype(jnp.float32))
        if limited:
            choice = _limit_groups(choice, expert_groups, top_groups)
        _, experts = _top_k(choice, top_k)
        top_p = jnp.take_along_axis(scores, experts, axis=-1)
    gates = top_p / top_p.sum(-1, keepdims=True) if top_k > 1 and renormalize else top_p
    if routed_scale != 1.0:
        gates = gates * routed_scale
    chosen = jax.nn.one_hot(experts, X, dtype=jnp.int32)                  # [B, L, k, X]
    in_order = chosen if order is None else chosen[:, np.argsort(order)]
    queue = in_order.swapaxes(1, 2).reshape(B, top_k * L, X)               # first choices first
    place = ((jnp.cumsum(queue, axis=1) - 1) * queue).sum(-1)             # [B, k*L]
    positions = place.reshape(B, top_k, L).swapaxes(1, 2)
    positions = positions if order is None else positions[:, order]
    keep = positions < capacity_per_row
    counts = chosen.sum((1, 2))
    fraction, mean_score = counts / (L * top_k), mean_of.mean(1)          # [B, X] each
    aux = (X * (fraction * mean_score).sum(-1)).mean()
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return Routing(experts, positions, gates * keep, keep, counts, aux, z, jnp.mean(~keep, dtype=jnp.float32))


def _limit_groups(choice_BLX, groups: int, top: int):
    """Group-limited selection (DeepSeek-V3): the selection scores of the experts outside each
    token's `top` best of `groups` consecutive groups set to -inf. A group's score is the sum of
    its two best selection scores (whichever of tied ones is masked, the sum is the same); the
    groups are chosen by argmaxes (ties: the lower group), as the experts are (`_top_k`)."""
    B, L, X = choice_BLX.shape
    grouped = choice_BLX.reshape(B, L, groups, X // groups)
    best = jax.nn.one_hot(jnp.argmax(grouped, axis=-1), X // groups, dtype=bool)
    first, second = grouped.max(-1), jnp.where(best, -jnp.inf, grouped).max(-1)
    _, picked = _top_k(first + second, top)                                # [B, L, top]
    allowed = jax.nn.one_hot(picked, groups, dtype=bool).any(-2)           # [B, L, groups]
    return jnp.where(allowed[..., None], grouped, -jnp.inf).reshape(B, L, X)


def _top_k(probs_BLX, k: int):
    """lax.top_k by k argmaxes (ties: the lower index first, as lax.top_k): XLA splits these
    along the batch, while it gathers a top_k's whole operand onto every device."""
    values, indices, left = [], [], probs_BLX
    for _ in range(k):
        index = jnp.argmax(left, axis=-1)
        values.append(jnp.take_along_axis(probs_BLX, index[..., None], axis=-1)[..., 0])
        indices.append(index.astype(jnp.int32))
        left = jnp.where(jax.nn.one_hot(index, probs_BLX.shape[-1], dtype=bool), -jnp.inf, left)
    return jnp.stack(values, -1), jnp.stack(indices, -1)


class MoE(nnx.Module):
    """num_experts MLPs of the model's kind (cfg.arch.mlp, with biases when cfg.arch.mlp_bias)
    behind a top-k router."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        m = cfg.moe
        D, X, F = cfg.d_model, m.num_experts, m.d_ff or cfg.d_ff
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.spec, self.kind, self.biased, self.strategy = m, MLPS[cfg.arch.mlp], cfg.arch.mlp_bias, cfg.strategy
        self.router = normal(rngs, (D, X), ("embed", "router"), cfg.init_std)
        self.kind.attach(self, self.biased,
                         lambda n, output: (normal(rngs, (X, F, D), EXPERT_AXES[f"w_{n}"], out_std) if output else
                                            normal(rngs, (X, D, F), EXPERT_AXES[f"w_{n}"], cfg.init_std)),
                         lambda n, output: zeros((X, D) if output else (X, F), EXPERT_AXES[f"bias_{n}"]))
        if m.biased:  # moved by `balance` after each step, never by the optimizer (no gradient)
            self.bias_balance = zeros((X,), ("router",))
        if m.num_shared:  # DeepSeek's shared experts: a dense MLP beside the routed ones
            shared = dataclasses.replace(cfg, d_ff=m.num_shared * F)
            self.shared = MLP(shared, rngs)

    def experts(self) -> dict:
        return {name: getattr(self, name)[...] for name in self.kind.names(self.biased)}

    def __call__(self, x_BLD):
        """(out_BLD, router statistics: STATS' scalars and LOAD, this layer's share of the
        assignments per expert)."""
        logits_BLX = jnp.einsum("BLD,DX->BLX", x_BLD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        s, length = self.strategy, x_BLD.shape[1]
        order = None if s.context == "none" else context.zigzag_order(length, s.mesh.shape[context.AXIS])
        bias = self.bias_balance[...] if self.spec.biased else None
        routing = route(constrain(logits_BLX, s.layout, ("batch", "act_length", None)), self.spec.top_k,
                        capacity(length, self.spec), order, bias, **self.spec.router())
        cap = 0 if self.spec.capacity_factor == 0 else capacity(length, self.spec)
        out_BLD = dispatch_combine(x_BLD, routing, self.experts(), self.spec.num_experts, cap, self.kind,
                                   self.strategy, self.spec.hidden_chunk)
        if self.spec.num_shared:
            out_BLD = out_BLD + self.shared(x_BLD)
        load = routing.counts.sum(0) / routing.counts.sum()
        return out_BLD, {**dict(zip(STATS, (routing.aux_loss, routing.z_loss, routing.dropped))), LOAD: load}


def expert_mlp(x_XTD, w: dict, kind: MLPKind, layout=None):
    """Each expert's MLP (of `kind`) on its own tokens: [experts, tokens, D] -> same."""
    def dot(x, w, output):
        return jnp.einsum("XTF,XFD->XTD" if output else "XTD,XDF->XTF", x, w)

    return kind.run(x_XTD, w, dot, lambda y, b: y + b[:, None],
                    lambda h_XTF: constrain(h_XTF, layout, (None, "batch", "act_mlp")))


def slices(width: int, most: int) -> int:
    """How many equal slices a hidden width of `width` runs in: the fewest of at most `most`
    columns each (0: one)."""
    return next(n for n in range(1, width + 1) if width % n == 0 and (not most or width // n <= most))


def grouped_mlp(x_TD, experts_T, sizes_X, w: dict, kind: MLPKind, hidden_chunk: int = 0):
    """Each expert's MLP (of `kind`) on its own rows of x_TD, which are sorted by expert (sizes_X
    of each): grouped matmuls (lax.ragged_dot), nothing padded to a capacity. The hidden width
    runs in slices of at most `hidden_chunk` columns (`slices`; 0: whole) one after another,
    their output projections summed in float32, each slice recomputed in the backward pass: the
    hidden activations are never whole (a dropless layer's rows are sized for the worst-case
    routing, far more than it usually gets)."""
    out_w, out_b = f"w_{kind.output}", f"bias_{kind.output}"
    hidden = w[out_w].shape[1]
    chunks = slices(hidden, hidden_chunk)

    def bias(y, b):
        return y + b[experts_T].astype(y.dtype)

    def dot(a, b, output):
        wide = output and chunks > 1  # a slice's share of the output, summed in float32
        return jax.lax.ragged_dot(a, b.astype(a.dtype), sizes_X, preferred_element_type=jnp.float32 if wide else None)

    if chunks == 1:
        return kind.run(x_TD, w, dot, bias)
    width = hidden // chunks

    def part(y, i):
        def cut(name, a):  # the slice of the hidden width: [X, F, D]'s second axis, else the last
            return jax.lax.dynamic_slice_in_dim(a, i * width, width, 1 if name == out_w else a.ndim - 1)
        return y + kind.run(x_TD, {n: cut(n, a) for n, a in w.items() if n != out_b}, dot, bias), None

    y, _ = jax.lax.scan(jax.checkpoint(part), jnp.zeros(x_TD.shape, jnp.float32), jnp.arange(chunks))
    return (bias(y, w[out_b]) if out_b in w else y).astype(x_TD.dtype)


def _dropless(x_BLD, experts_BLK, weights_BLK, w: dict, *, num_experts: int, kind: MLPKind, groups: int,
              exchange: bool, hidden_chunk: int = 0):
    """sum_k weight_k * expert_k(x) for this device's rows, no token dropped: its assignments
    sorted by expert (stable: in token order within an expert), the experts as grouped matmuls,
    the results put back in token order and combined with the router's weights. With groups > 1
    (inside shard_map over `expert`) the sorted rows travel to the devices owning their experts
    and back (parallel.ragged; `exchange`: by lax.ragged_all_to_all, else emulated); the experts'
    hidden activations in slices of at most `hidden_chunk` columns (grouped_mlp)."""
    B, L, D = x_BLD.shape
    k = experts_BLK.shape[-1]
    experts = experts_BLK.reshape(B * L * k)
    order = jnp.argsort(experts, stable=True)             # assignment at each sorted place
    sizes = jnp.bincount(experts, length=num_experts).astype(jnp.int32)
    x_TD = x_BLD.reshape(B * L, D)[order // k]
    if groups == 1:
        y_TD = grouped_mlp(x_TD, experts[order], sizes, w, kind, hidden_chunk)
    else:
        r, local = ragged.routes(sizes, AXIS, groups), num_experts // groups
        rows_MD = ragged.send(x_TD, r, AXIS, groups * B * L * min(k, local), exchange)  # all that can come
        which = jnp.searchsorted(jnp.cumsum(r.local_sizes), jnp.arange(rows_MD.shape[0]), side="right")
        y_MD = grouped_mlp(rows_MD, jnp.minimum(which, local - 1), r.local_sizes, w, kind, hidden_chunk)
        y_TD = ragged.back(y_MD, x_TD.shape[0], r, AXIS, exchange)
    y_BLKD = y_TD[jnp.argsort(order)].reshape(B, L, k, D)
    out_BLD = jnp.einsum("BLKD,BLK->BLD", y_BLKD, weights_BLK.astype(y_BLKD.dtype),
                         preferred_element_type=jnp.float32)
    return out_BLD.astype(x_BLD.dtype)


def _slots(routing: Routing, num_experts: int, cap: int):
    """int32 [B, L, k]: each assignment's slot in a row's [experts * capacity] buffer; dropped
    ones point past its end (scatters skip them, gathers read 0)."""
    return jnp.where(routing.keep, routing.experts * cap + routing.positions, num_experts * cap)


def _local(x_BLD, slots_BLK, weights_BLK, w: dict, *, num_experts: int, cap: int, kind: MLPKind, groups: int,
           layout=None):
    """Dispatch, expert MLPs and combine for this device's rows. With groups > 1 (inside
    shard_map over `expert`, whose size it is) the local experts are num_experts / groups and
    the slots of the others travel by all-to-all."""
    B, L, D = x_BLD.shape
    k = slots_BLK.shape[-1]

    def scatter(x_LD, slots_LK):
        src = jnp.broadcast_to(x_LD[:, None], (L, k, D)).reshape(L * k, D)
        return jnp.zeros((num_experts * cap, D), x_LD.dtype).at[slots_LK.reshape(-1)].add(src, mode="drop")

    buf = jax.vmap(scatter)(x_BLD, slots_BLK).reshape(B, groups, num_experts // groups, cap, D)
    if groups > 1:  # [rows, destination group, ...] -> [rows, source group, local experts, ...]
        buf = jax.lax.all_to_all(buf, AXIS, 1, 1, tiled=True)
    local = num_experts // groups
    tokens_XTD = buf.transpose(2, 0, 1, 3, 4).reshape(local, B * groups * cap, D)
    y_XTD = expert_mlp(constrain(tokens_XTD, layout, (None, "batch", "act_embed")), w, kind, layout)
    y = constrain(y_XTD, layout, (None, "batch", "act_embed"))
    y = y.reshape(local, B, groups, cap, D).transpose(1, 2, 0, 3, 4)
    if groups > 1:
        y = jax.lax.all_to_all(y, AXIS, 1, 1, tiled=True)
    y_BSD = y.reshape(B, num_experts * cap, D)

    def pick(y_SD, slots_LK):
        return jnp.take(y_SD, slots_LK.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(L, k, D)

    out_BLKD = jax.vmap(pick)(y_BSD, slots_BLK)
    out_BLD = jnp.einsum("BLKD,BLK->BLD", out_BLKD, weights_BLK.astype(out_BLKD.dtype),
                         preferred_element_type=jnp.float32)
    return out_BLD.astype(x_BLD.dtype)


def _gather_weights(w: dict, specs: dict) -> dict:
    """Inside shard_map: each expert weight whole except for its split over `expert` (FSDP's gather)."""
    return {name: fsdp.gather(x, tuple(tuple(a for a in e if a != AXIS) for e in specs[name]), x.dtype.name)
            for name, x in w.items()}


def _own(w: dict, local: int) -> dict:
    """Inside a map manual over `expert`: this device's `local` experts of each expert weight.
    The layer's map (parallel.fsdp) passes them so already; a pipeline stage (parallel.executor)
    holds its layers' weights whole over the batch axes, so its expert weights are sliced here
    (their gradients, zero elsewhere, are summed over the batch axes at the stage's edge)."""
    def mine(x):
        if x.shape[0] == local:
            return x
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * local, local, 0)
    return {name: mine(x) for name, x in w.items()}


def dispatch_combine(x_BLD, routing: Routing, w: dict, num_experts: int, cap: int, kind: MLPKind,
                     strategy: Strategy = Strategy(), hidden_chunk: int = 0):
    """sum_k weight_k * expert_k(x) for every token, through capacity buffers of `cap` slots a
    row, or dropless (cap 0, the hidden activations in slices of `hidden_chunk` columns): with
    strategy.experts=all_to_all the experts are split over `expert` (exchanges inside
    shard_map), else they run on this program's devices."""
    layout = strategy.layout
    if cap:
        assigned, run = _slots(routing, num_experts, cap), functools.partial(_local, num_experts=num_experts,
                                                                              cap=cap, kind=kind, layout=layout)
    else:
        native = layout is not None and layout.compiler != "cpu"  # XLA:CPU has no ragged all-to-all
        assigned, run = routing.experts, functools.partial(_dropless, num_experts=num_experts, kind=kind,
                                                           exchange=native, hidden_chunk=hidden_chunk)
    if strategy.experts == "local":
        return run(x_BLD, assigned, routing.weights, w, groups=1)
    run = functools.partial(run, groups=layout.mesh.shape[AXIS])
    if AXIS in manual_here():  # in the layer's map (parallel.fsdp) or a
        return run(x_BLD, assigned, routing.weights, _own(w, num_experts // layout.mesh.shape[AXIS]))  # stage's
    here = layout.here()  # axes still to split here
    batch = entries(here.spec(("batch",)), 1)[0]  # the batch axes: manual inside, with `expert`
    specs, placed = {}, {}
    for name, x in w.items():
        dims = list(entries(here.spec(EXPERT_AXES[name]), x.ndim))
        dims[0] = (AXIS,)  # each device holds its own experts whatever the rule says
        specs[name] = [tuple(a for a in e if a in batch) for e in dims]
        placed[name] = constrain(x, layout, to_spec(dims))

    def local(x, assigned, weights, w):
        return run(x, assigned, weights, _gather_weights(w, specs))

    rows = to_spec([batch])
    return jax.shard_map(local, mesh=layout.mesh_here(),
                         in_specs=(rows, rows, rows, {n: to_spec(e) for n, e in specs.items()}),
                         out_specs=rows, axis_names=set(batch), check_vma=False)(
                             x_BLD, assigned, routing.weights, placed)


def expert_param_count(params: dict) -> int:
    """Parameters of the routed expert MLPs (split over `expert`; a token uses top_k of
    num_experts): not the router, not the shared experts (every token uses them)."""
    mlp = params.get("layers", {}).get("moe", {}).get("mlp", {})
    return sum(math.prod(v.shape) for k, v in mlp.items() if k not in ("router", "shared"))


def balance(params: dict, load_GX, rate: float) -> dict:
    """Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer's selection bias moves by
    `rate` towards the experts that took less than an even share of the step's assignments
    (load_GX: [MoE layers, experts], over the whole batch) and away from those that took more."""
    def move(path, leaf):
        if jax.tree_util.keystr(path) != BIAS_PATH:
            return leaf
        return leaf + (rate * jnp.sign(1.0 / load_GX.shape[-1] - load_GX)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(move, params)
