"""One SPMD executor for every pipeline schedule: it runs a `schedules.Table` inside shard_map
over `pipeline`, forward and backward together, so the activations held are what the table
says (its microbatches in flight), not all M.

Each device scans the table's ticks and at each one takes its stage's action, by lax.switch:
- F: the forward of its layer chunk on a microbatch, on the input that arrived from the
  previous stage (the first virtual stage embeds the tokens instead); the input is kept in a
  stash slot until the backward; the output is sent on.
- B: the backward of that chunk by jax.vjp, recomputing its forward from the kept input (the
  stage is rematerialised whole, as GPipe's checkpointed stage was); the last virtual stage
  runs the final norm, the head and the loss here, so no stage's logits are kept; the first adds
  the embedding's gradient. The input gradient is sent back. When the table splits W off
  (zero-bubble), B computes the input gradient only and W the weight gradient later.
Every tick sends one message each way (collective permutes: stage s to s+1, and back); the
receiver files it in the stash slot the table assigned. Stash slots are given out per stage
from the table before tracing (`_Plan`), so their count is the table's peak in flight.

The embedding runs only on the first stage and the head and loss only on the last: no stage
computes another's work and no activation is summed over `pipeline`. At the end the loss and
the gradients of the embedding and head (parameter-sized) are summed over `pipeline`, and
everything over the batch's axes.

A stage also returns statistics (an MoE stage: its router losses and loads). Each B action
adds its chunk's to a per-chunk sum, and what they add to the objective (`Fns.extra`, linear)
is differentiated with the stage: its cotangent is 1, as the head's loss's is. They come back
per virtual stage, in layer order, averaged over the microbatches and batch shards.

`pipelined_loss` wraps the executor as a jax.custom_vjp: its forward pass runs the table and
keeps the gradients; the backward scales them by the incoming cotangent. Evaluated without
differentiation, it runs `primal` instead (a forward-only pass).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxscale.parallel import microbatch
from jaxscale.parallel.schedules import ACTIONS, B, F, Table, W
from jaxscale.sharding import to_spec

AXIS = "pipeline"


class Fns(NamedTuple):
    """The model's parts the executor runs. embed(outer, tokens, places) -> x; stage(chunk
    params, x, places, chunk) -> (x, statistics: a dict of float32 arrays, {} for none), chunk the
    chunk's index among the model's chunks of layers (virtual stage c*P + s); head_loss(outer,
    x, targets, count) -> mean loss of the microbatch's rows (with a loss mask, count, a float32
    scalar: the sum over its trained targets divided by it; else None); place(x) -> x laid out as the model's
    activations (every branch of the executor's conditionals states it, or the partitioner sees
    branches disagree); extra(statistics) -> what they add to the objective (linear; 0.0 for none)."""

    embed: Callable
    stage: Callable
    head_loss: Callable
    place: Callable
    extra: Callable


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per (tick, stage) int32 arrays [T, P] the executor reads: the action (kind, microbatch,
    chunk, first/last virtual stage), the stash slots it reads, and where the messages arriving
    at that tick are filed (-1: none)."""

    kind: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    first: np.ndarray
    last: np.ndarray
    x_slot: np.ndarray
    g_slot: np.ndarray
    x_arrives: np.ndarray
    g_arrives: np.ndarray
    x_slots: int
    g_slots: int


def plan(table: Table) -> _Plan:
    """Stash slots for the table: an input kept from its arrival (or, for the first virtual
    stage, its F) to its last use; an output gradient from its arrival to its last use."""
    P, V = table.stages, table.virtual
    last_vstage, final = P * V - 1, W if table.split_backward else B
    times = table.times()
    shape = table.kind.shape
    x_slot, g_slot, x_arrives, g_arrives = (np.full(shape, -1, np.int32) for _ in range(4))
    x_live, g_live = [], []  # (stage, start, end, micro, vstage)
    for (kind, m, j), t in times.items():
        if kind != F:
            continue
        start = t if j == 0 else times[(F, m, j - 1)] + 1
        x_live.append((j % P, start, times[(final, m, j)], m, j))
        if j < last_vstage:
            g_live.append((j % P, times[(B, m, j + 1)] + 1, times[(final, m, j)], m, j))
    x_of, x_count = _allocate(x_live, P)
    g_of, g_count = _allocate(g_live, P)
    for (s, start, _, m, j) in x_live:
        if j:
            x_arrives[start, s] = x_of[(m, j)]
    for (s, start, _, m, j) in g_live:
        g_arrives[start, s] = g_of[(m, j)]
    for t, s in zip(*np.nonzero(table.kind)):
        m, j = int(table.micro[t, s]), int(table.vstage[t, s])
        x_slot[t, s] = x_of[(m, j)]
        g_slot[t, s] = g_of.get((m, j), 0)
    return _Plan(table.kind.astype(np.int32), table.micro.astype(np.int32), (table.vstage // P).astype(np.int32),
                 (table.vstage == 0).astype(np.int32), (table.vstage == last_vstage).astype(np.int32),
                 x_slot, np.maximum(g_slot, 0), x_arrives, g_arrives, max(x_count, 1), max(g_count, 1))


def _allocate(intervals, stages: int) -> tuple[dict, int]:
    """Slots per stage for [start, end] intervals (greedy by start): {(micro, vstage): slot}, and
    the most any stage needs."""
    slots, most = {}, 0
    for s in range(stages):
        free_at: list[int] = []  # per slot: the first tick it is free again
        for (_, start, end, m, j) in sorted(i for i in intervals if i[0] == s):
            slot = next((k for k, t in enumerate(free_at) if t <= start), len(free_at))
            free_at[slot:slot + 1] = [end + 1]
            slots[(m, j)] = slot
        most = max(most, len(free_at))
    return slots, most


class _State(NamedTuple):
    """What a device carries from tick to tick."""

    xs: jax.Array        # [x slots, b, L, D]: stage inputs kept until their backward
    gs: jax.Array        # [g slots, b, L, D]: output gradients kept until used
    g_chunks: dict       # float32 gradients of this device's layer chunks, [V, ...]
    g_outer: dict        # float32 gradients of the embedding, final norm and head
    loss: jax.Array      # float32 sum of the microbatch losses computed here
    stats: dict          # float32 sums of this device's chunks' statistics, [V, ...]


class _Device:
    """One device inside the map: its layer chunks, the outer parameters, its microbatches, and
    one method per action kind, each (action row, state) -> (state, (sent ahead, sent back))."""

    def __init__(self, fns: Fns, chunks, outer, tokens, targets, places, count):
        self.fns, self.count = fns, count
        self.chunks, self.outer, self.tokens, self.targets, self.places = chunks, outer, tokens, targets, places
        x0 = jax.eval_shape(fns.embed, outer, tokens[0], self.take(0))
        self.zeros = self.place(jnp.zeros(x0.shape, x0.dtype))
        virtual = jax.tree.leaves(chunks)[0].shape[0]
        stats = jax.eval_shape(fns.stage, self.chunk(0), x0, self.take(0), 0)[1]
        self.no_stats = jax.tree.map(lambda s: jnp.zeros((virtual, *s.shape), jnp.float32), stats)

    def embed(self, outer, tokens, places):
        return self.fns.embed(outer, tokens, places)

    def place(self, x):
        return self.fns.place(x)

    def stage(self, params, x, places, c):
        """Local chunk c's output and (its statistics, what they add to the objective)."""
        y, stats = self.fns.stage(params, x, places, c * jax.lax.axis_size(AXIS) + jax.lax.axis_index(AXIS))
        return y, (stats, jnp.asarray(self.fns.extra(stats), jnp.float32))

    def take(self, m):
        return jax.tree.map(lambda p: p[m], self.places)

    def chunk(self, c):
        return jax.tree.map(lambda p: p[c], self.chunks)

    def start(self, slots: _Plan) -> _State:
        stash = functools.partial(jnp.zeros, dtype=self.zeros.dtype)
        zeros32 = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
        return _State(stash((slots.x_slots, *self.zeros.shape)), stash((slots.g_slots, *self.zeros.shape)),
                      zeros32(self.chunks), zeros32(self.outer), jnp.zeros((), jnp.float32), self.no_stats)

    def idle(self, a, state: _State):
        return state, (self.zeros, self.zeros)

    def forward(self, a, state: _State):
        """The chunk's forward on the input that arrived (or the embedded tokens), which is kept;
        the last chunk only keeps it: its forward runs in its backward, with the head and loss."""
        m = a["micro"]
        x = jax.lax.cond(a["first"] == 1, lambda: self.place(self.embed(self.outer, self.tokens[m], self.take(m))),
                         lambda: self.place(state.xs[a["x_slot"]]))
        y = jax.lax.cond(a["last"] == 1, lambda: self.zeros,
                         lambda: self.place(self.stage(self.chunk(a["chunk"]), x, self.take(m), a["chunk"])[0]))
        return state._replace(xs=state.xs.at[a["x_slot"]].set(x)), (y, self.zeros)

    def backward(self, a, state: _State, with_weights: bool = True):
        """The input gradient, sent back and, on the first chunk, on into the embedding; the
        weight gradients too unless W runs them apart."""
        dp, do, dx, loss, stats = self._grads(a, state)
        de = self._into_embedding(a, dx)
        if with_weights:
            state = self._add(state, a, dp, jax.tree.map(jnp.add, do, de))
        else:
            state = self._add(state, a, None, de)
        stats = jax.tree.map(lambda total, s: total.at[a["chunk"]].add(s), state.stats, stats)
        return state._replace(loss=state.loss + loss, stats=stats), (self.zeros, dx.astype(self.zeros.dtype))

    def weight(self, a, state: _State):
        dp, do, _, _, _ = self._grads(a, state)
        return self._add(state, a, dp, do), (self.zeros, self.zeros)

    def _no_outer(self):
        return jax.tree.map(jnp.zeros_like, self.outer)

    def _grads(self, a, state: _State):
        """(chunk grads, outer grads, input grad, loss, the chunk's statistics) of the action's
        chunk on its microbatch, by jax.vjp from the kept input (the last chunk with the head and
        loss), the statistics' share of the objective differentiated with it. What a caller
        drops (B without W's grads, W's input grad) XLA removes."""
        c, m, x = a["chunk"], a["micro"], state.xs[a["x_slot"]]
        g = state.gs[a["g_slot"]]

        def objective(p, o, x):
            """The chunk, then on the last chunk the head's loss, elsewhere <y, g>, whose gradient
            in y is the arrived g: one vjp serves every chunk, so the program holds the chunk's
            forward and backward once. (objective, (loss, statistics))."""
            y, (stats, extra) = self.stage(p, x, self.take(m), c)

            def at_last():
                loss = self.fns.head_loss(o, y, self.targets[m], self.count).astype(jnp.float32)
                return loss, loss

            def inside():
                return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), jnp.zeros((), jnp.float32)

            value, loss = jax.lax.cond(a["last"] == 1, at_last, inside)
            return value + extra, (loss, stats)

        _, vjp, (loss, stats) = jax.vjp(objective, self.chunk(c), self.outer, x, has_aux=True)
        dp, do, dx = vjp(jnp.ones((), jnp.float32))
        return dp, do, self.place(dx), loss, stats

    def _into_embedding(self, a, dx):
        """The outer grads of the first chunk's input grad dx (the embedding's); zeros elsewhere."""
        m = a["micro"]

        def into():
            return jax.vjp(lambda o: self.embed(o, self.tokens[m], self.take(m)), self.outer)[1](dx)[0]

        return jax.lax.cond(a["first"] == 1, into, self._no_outer)

    @staticmethod
    def _add(state: _State, a, dp, do) -> _State:
        """The state with chunk grads dp (None: none) and outer grads do added, in float32."""
        g_outer = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), state.g_outer, do)
        if dp is None:
            return state._replace(g_outer=g_outer)
        g_chunks = jax.tree.map(lambda g, d: g.at[a["chunk"]].add(d.astype(g.dtype)), state.g_chunks, dp)
        return state._replace(g_chunks=g_chunks, g_outer=g_outer)


def _run_table(the_plan: _Plan, device: _Device, stages: int, split: bool):
    """The per-device loop over the table's ticks: (loss sum, chunk grads, outer grads, chunk
    statistics' sums)."""
    me = jax.lax.axis_index(AXIS)
    columns = {name: jnp.asarray(getattr(the_plan, name)) for name in
               ("kind", "micro", "chunk", "first", "last", "x_slot", "g_slot", "x_arrives", "g_arrives")}
    # In the order of schedules.IDLE, F, B, W. A table without W actions compiles no W branch
    # (it would hold the chunk's forward and backward once more).
    branches = [device.idle, device.forward, functools.partial(device.backward, with_weights=not split),
                device.weight if split else device.idle]
    ahead = [(i, (i + 1) % stages) for i in range(stages)]
    behind = [((i + 1) % stages, i) for i in range(stages)]

    def tick(carry, row):
        state, x_in, g_in = carry
        a = {name: value[me] for name, value in row.items()}
        state = state._replace(xs=_file(state.xs, a["x_arrives"], x_in), gs=_file(state.gs, a["g_arrives"], g_in))
        with jax.named_scope(ACTIONS):  # its branch shares are the table's (jaxscale.analysis.step_plan)
            state, (x_out, g_out) = jax.lax.switch(a["kind"], branches, a, state)
        return (state, jax.lax.ppermute(x_out, AXIS, ahead), jax.lax.ppermute(g_out, AXIS, behind)), None

    zeros = device.zeros
    (state, _, _), _ = jax.lax.scan(tick, (device.start(the_plan), zeros, zeros), columns)
    return state.loss, state.g_chunks, state.g_outer, state.stats


def _file(stash, slot, message):
    """The stash with the arrived message in `slot` (unchanged when slot is -1)."""
    at = jnp.maximum(slot, 0)
    return stash.at[at].set(jnp.where(slot >= 0, message, stash[at]))


def pieces(table: Table, layout) -> int:
    """The pieces whose losses the schedule averages: each microbatch on each batch shard."""
    return table.microbatches * math.prod(layout.mesh.shape[a] for a in layout.batch_axes(AXIS))


def run(table: Table, fns: Fns, stacked, outer, tokens_BL, targets_BL, places, layout, kept=None, trained=None):
    """(mean loss, gradients of the stacked layer params and of the outer params, the stages'
    statistics [P * V, ...] in layer order, means over the microbatches): the schedule run over
    `pipeline` on M = table.microbatches microbatches of the batch, the gradients those of the
    loss plus what the statistics add. stacked has the layer dimension first, split over
    `pipeline`; places is a pytree of [B, L] arrays (positions, segment ids). A stage holds its
    layers' weights whole over the batch axes but for the splits `kept` names (per stacked leaf,
    one tuple of mesh axes per dimension, sharding.Stored.kept: the experts' over `expert`, each
    device its own experts); their gradients are summed over the other batch axes only. With a
    loss mask (targets IGNORE where not trained) `trained` is the whole batch's trained targets
    over its pieces (step.trained): each of the `pieces` here divides by its share of it."""
    stages, virtual, count = table.stages, table.virtual, table.microbatches
    the_plan, batch = plan(table), layout.batch_axes(AXIS)
    scale = 1.0 / pieces(table, layout)
    kept = jax.tree.map(lambda p: ((),) * p.ndim, stacked) if kept is None else kept

    def regroup(p):  # [L, ...] -> [V, P, L/(PV), ...]: virtual stage j = c*P + s on device s
        return p.reshape(virtual, stages, p.shape[0] // (virtual * stages), *p.shape[1:])

    def chunk_spec(dims):  # a regrouped leaf's spec: the stages over pipeline, the kept splits
        return to_spec(((), (AXIS,), (), *(tuple(a for a in e if a in batch) for e in dims[1:])))

    def summed_over(dims):  # the batch axes a leaf's gradient is summed over
        return tuple(a for a in batch if not any(a in e for e in dims))

    def body(chunks, outer, tokens, targets, places, trained):
        share = None if trained is None else trained / pieces(table, layout)
        device = _Device(fns, jax.tree.map(lambda p: p[:, 0], chunks), outer, tokens, targets, places, share)
        loss, g_chunks, g_outer, stats = _run_table(the_plan, device, stages, table.split_backward)
        everywhere = (AXIS, *batch)

        def per_chunk(g, dims=((),)):
            axes = summed_over(dims)
            return (jax.lax.psum(g, axes) if axes else g)[:, None] * scale

        return (jax.lax.psum(loss, everywhere) * scale, jax.tree.map(per_chunk, g_chunks, kept),
                jax.tree.map(lambda g: jax.lax.psum(g, everywhere) * scale, g_outer), jax.tree.map(per_chunk, stats))

    rows = P(None, batch or None)
    split = functools.partial(microbatch.split, count=count)
    args = (jax.tree.map(regroup, stacked), outer, split(tokens_BL), split(targets_BL), jax.tree.map(split, places),
            trained)
    chunk_specs = jax.tree.map(lambda _, dims: chunk_spec(dims), stacked, kept)
    specs = (chunk_specs, P(), rows, rows, jax.tree.map(lambda _: rows, places), None if trained is None else P())
    loss, g_chunks, g_outer, stats = jax.shard_map(
        body, mesh=layout.mesh_here(), in_specs=specs, out_specs=(P(), chunk_specs, P(), P(None, AXIS)),
        axis_names={AXIS, *batch}, check_vma=False)(*args)
    g_stacked = jax.tree.map(lambda g, p: g.reshape(p.shape).astype(p.dtype), g_chunks, stacked)
    stats = jax.tree.map(lambda s: s.reshape(virtual * stages, *s.shape[2:]), stats)  # [V, P, ...]: j = v*P + p
    return loss, g_stacked, jax.tree.map(lambda g, p: g.astype(p.dtype), g_outer, outer), stats


def pipelined_loss(table: Table, fns: Fns, primal, finish, layout, kept=None):
    """loss(stacked, outer, tokens, targets, places, count) -> (objective, metrics) as a
    jax.custom_vjp (count: see run): differentiated, the table runs forward and backward together (`run`, whose
    stages keep the splits `kept` names) and finish(mean loss, statistics [P * V, ...]) gives
    what primal(...) gives evaluated alone. The metrics are not differentiated: their cotangent
    is ignored."""
    @jax.custom_vjp
    def loss(stacked, outer, tokens, targets, places, count):
        return primal(stacked, outer, tokens, targets, places, count)

    def forward(stacked, outer, tokens, targets, places, count):
        value, g_stacked, g_outer, stats = run(table, fns, stacked, outer, tokens, targets, places, layout, kept,
                                               count)
        return finish(value, stats), (g_stacked, g_outer, tokens, targets, places, count)

    def backward(residuals, cotangents):
        g_stacked, g_outer, tokens, targets, places, count = residuals
        cotangent = cotangents[0]
        scale = functools.partial(jax.tree.map, lambda g: (g * cotangent).astype(g.dtype))
        zero = functools.partial(jax.tree.map, lambda x: np.zeros(x.shape, jax.dtypes.float0))
        return (scale(g_stacked), scale(g_outer), zero(tokens), zero(targets), zero(places),
                jax.tree.map(jnp.zeros_like, count))

    loss.defvjp(forward, backward)
    return loss
