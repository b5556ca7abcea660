"""FSDP and ZeRO-3 written out: weights gathered where they are used, gradients reduce-scattered.

A layer runs in shard_map over the axes its batch is split over (data, fsdp, expert; and the
sequence axis under context parallelism: `map_axes`); the embedding and the head do likewise
(`models.vocab`). Inside, each device holds its own rows and gathers each weight it uses from its
shards, in the compute dtype, with one all-gather over the axes that split it (`gather`); the
transpose of that gather is the gradient's reduce-scatter back into the shards (in stages over a
TPU torus: `parallel.rings`). A weight whole over some of the map's axes (data under ZeRO 0-2)
enters the map whole, and its gradient is summed over them at the map's edge, once per layer.

Weights cross the map's edge in the reduce dtype (`Weights.reduce`): the compute dtype unless
`optim.grad_reduce_dtype=float32` asks for float32, so by default the all-gathers and the
gradients' reduce-scatters and all-reduces move bfloat16 when the compute is bfloat16.

Left to the partitioner, a gradient's reduction into its shards came out as an all-reduce of the
whole gradient and a slice, from XLA:CPU and from the TPU compiler on v4/v5p/v6e slices alike
(twice the bytes, and the whole gradient in memory), in whatever dtype it met the reduction.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale import sharding
from jaxscale.parallel import rings
from jaxscale.sharding import Entries, keep, to_spec


@dataclasses.dataclass(frozen=True)
class Weights:
    """How a model's weights are used: cast to `compute` where they are used, their gradients
    reduced across devices in `reduce` (which is also the dtype they cross a map's edge in)."""

    compute: str = "float32"
    reduce: str = "float32"

    @classmethod
    def of(cls, compute, reduce=None, compiler: str = "") -> Weights:
        """`reduce` None: the compute dtype; float32 where `compiler` cannot reduce it
        (`sharding.reduces_in_float32`)."""
        compute = jnp.dtype(compute)
        reduce = jnp.dtype(reduce or compute)
        if sharding.reduces_in_float32(compiler, reduce):
            reduce = jnp.dtype(jnp.float32)
        return cls(compute.name, reduce.name)


def map_axes(layout: sharding.Layout | None, length: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the axes a layer's map makes manual along the batch, along the length): every axis the
    batch is split over (data, fsdp, expert) that is not manual already, in the batch's order,
    and with `length` the sequence axes of the residual stream (context parallelism); none where
    none of them can split weights. All of the batch's, because a manual axis after an automatic
    one on the same dimension makes the partitioner move the rows (measured: an all-gather and a
    permute of the activations over `data`); the length's too, so that a weight whole over
    several of them has its gradient summed over all of them at once."""
    if layout is None:
        return (), ()
    rows = layout.batch_axes()
    if not set(rows) & set(layout.weight_axes):
        return (), ()
    return rows, layout.axes("act_length") if length else ()


def _gather_fwd(x, dims: Entries, compute: str):
    y = x.astype(compute)
    for dim, axes in enumerate(dims):
        if axes:
            y = jax.lax.all_gather(y, axes, axis=dim, tiled=True)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather(x, dims: Entries, compute: str, plans: tuple[rings.Stages, ...] = ()):
    """x, a weight's shard inside a map, whole over the manual axes `dims` names, cast to
    `compute` first (so the all-gather moves the compute dtype). The gradient comes back in
    x's dtype: cast, then reduce-scattered into x's shard (each dimension's in the stages of
    `plans`, see parallel.rings)."""
    return _gather_fwd(x, dims, compute)


def _fwd(x, dims, compute, plans):
    return _gather_fwd(x, dims, compute), jnp.zeros((), x.dtype)


def _scatter(g, dims: Entries, plans: tuple[rings.Stages, ...]):
    """g reduce-scattered over the manual axes `dims` names, each dimension's in the stages of
    `plans`: the transpose of _gather_fwd's all-gathers."""
    for dim, axes in reversed(list(enumerate(dims))):
        if axes:
            g = rings.reduce_scatter(g, axes, dim, plans[dim] if plans else ())
    return g


def _bwd(dims, compute, plans, dtype_of_x, g):
    return (_scatter(g.astype(dtype_of_x.dtype), dims, plans),)


gather.defvjp(_fwd, _bwd)


def gather_plans(mesh, dims: Entries) -> tuple[rings.Stages, ...]:
    """Each dimension's reduce-scatter stages (parallel.rings) for `gather`."""
    return tuple(rings.stages(mesh, axes) for axes in dims)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How a weight's shard becomes whole in a layer's map: the manual axes each dimension is
    gathered over, their reduce-scatter stages, and the axes still free (tensor) that the gather
    maps over too (None: none)."""

    gathered: Entries
    plans: tuple[rings.Stages, ...]
    free: Entries | None


def _split(stored: sharding.Stored, axes: tuple[str, ...], layout: sharding.Layout) -> _Split:
    dims = stored.split
    gathered = tuple(tuple(a for a in e if a not in kept) for e, kept in
                     zip(keep(dims, tuple(a for a in axes if a in layout.weight_axes)), stored.kept))
    free = layout.free_axes()
    rest = tuple(tuple(a for a in e if a in free and layout.mesh.shape[a] > 1) for e in dims)
    return _Split(gathered, gather_plans(layout.mesh, gathered) if any(gathered) else (),
                  rest if any(rest) else None)


def _mapped(f, x, split: _Split, layout: sharding.Layout):
    """f(x) in a map over the weight's free axes (see _whole), or directly."""
    if split.free is None:
        return f(x)
    spec = to_spec(split.free)
    return jax.shard_map(f, mesh=layout.mesh_here(), in_specs=spec, out_specs=spec,
                         axis_names={a for e in split.free for a in e}, check_vma=False)(x)


def _whole(x, stored: sharding.Stored, axes: tuple[str, ...], compute: str, layout: sharding.Layout):
    """x (a weight's shard stored as `stored` says) whole over the map's `axes`, in the compute
    dtype, but for the splits it keeps (an expert weight's over `expert`). Its splits over other
    axes (tensor) stay: the gather runs in a map over them too, because in a partly manual region
    XLA gathers an operand's automatic dimensions before a collective (measured: every weight
    all-gathered over `tensor` under fsdp x tensor)."""
    split = _split(stored, axes, layout)
    if not any(split.gathered):
        return x.astype(compute)
    return _mapped(lambda x: gather(x, split.gathered, compute, split.plans), x, split, layout)


def _reduced(g, stored: sharding.Stored, axes: tuple[str, ...], dtype, layout: sharding.Layout):
    """The gradient of _whole's output, `g`, reduce-scattered into x's shard, in `dtype` (x's):
    _whole's transpose, on its own."""
    split = _split(stored, axes, layout)
    if not any(split.gathered):
        return g.astype(dtype)
    return _mapped(lambda g: _scatter(g.astype(dtype), split.gathered, split.plans), g, split, layout)


def run(fn, layout: sharding.Layout | None, weights: Weights, params, dims, x_BLD, places,
        remat=lambda f: f, length: bool = False):
    """fn(params, x_BLD, places) -> (y_BLD, stats) with `params` whole over the map's axes in the
    compute dtype: in shard_map over `map_axes` (each device its rows of x and of `places`, a
    pytree of [B, L] arrays, and with `length` its part of the length; stats, scalar means over
    its rows, averaged over the map), or directly where there is no such axis. `dims` gives each
    parameter's stored split and what the layer keeps of it (`Layout.placed`). `remat` wraps the
    gathers with fn: a rematerialised layer gathers its weights again in the backward pass
    (FSDP's reshard after forward), an unrematerialised one keeps them."""
    rows, along = map_axes(layout, length)
    axes = rows + along

    def use(params, x_BLD, places):
        if not axes:
            return fn(jax.tree.map(lambda p: p.astype(weights.compute), params), x_BLD, places)
        whole = jax.tree.map(lambda p, d: _whole(p, d, axes, weights.compute, layout), params, dims)
        y_BLD, stats = fn(whole, x_BLD, places)
        return y_BLD, jax.tree.map(lambda s: jax.lax.pmean(s, axes), stats)

    inward = jax.tree.map(lambda p: p.astype(weights.reduce), params)
    if not axes:
        return remat(use)(inward, x_BLD, places)
    specs = jax.tree.map(lambda _, d: to_spec(keep(d.split, axes)), params, dims)
    tokens = P(rows, along or None)
    return jax.shard_map(remat(use), mesh=layout.mesh_here(), in_specs=(specs, tokens, tokens),
                         out_specs=(tokens, P()), axis_names=set(axes), check_vma=False)(inward, x_BLD, places)


def reduced_in_loop(layout: sharding.Layout | None, dims) -> bool:
    """Whether a layer's gradients, `dims` its weights' stored splits (Layout.placed), are summed
    over every axis of its map (map_axes) of more than one device by its gathers' transposes,
    so that nothing is left for the map's edge but the small weights kept whole (norm scales)."""
    axes, _ = map_axes(layout)
    if not axes:
        return False
    gathered = {a for d in jax.tree.leaves(dims, is_leaf=lambda x: isinstance(x, sharding.Stored))
                for e in _split(d, axes, layout).gathered for a in e}
    return all(a in gathered for a in axes if layout.mesh.shape[a] > 1)


def scan_deferred(fn, layout: sharding.Layout, weights: Weights, params, dims, x_BLD, places, indices,
                  deferred: tuple[str, ...] | None = None):
    """The layers of stacked `params` ([layers, ...] each, stored as `dims` says of one layer) in
    a scan, fn(whole params, x, places) -> (y, {}) each, fully rematerialised, with each layer's
    gradient of the parameters under the keys `deferred` (None: all) reduce-scattered during the
    backward pass of the layer before it: the reduction depends on nothing that layer computes,
    so the compiler can run it beside that layer's matmuls, where a layer's own reduce-scatters
    wait for its last gradient. That part of one layer's gradient is kept whole in the meantime;
    the rest is reduced in its own layer's backward pass. For layers whose gradients are reduced
    within (reduced_in_loop); the small weights kept whole are summed at the map's edge, once for all."""
    axes, _ = map_axes(layout)
    inward = jax.tree.map(lambda p: p.astype(weights.reduce), params)
    specs = jax.tree.map(lambda _, d: P(None, *to_spec(keep(d.split, axes))), params, dims)
    tokens = P(axes)

    def whole(p):
        return jax.tree.map(lambda p, d: _whole(p, d, axes, weights.compute, layout), p, dims)

    def reduced(g):  # g: some of the keys of a layer's gradient
        return jax.tree.map(lambda g, d: _reduced(g, d, axes, weights.reduce, layout), g, {k: dims[k] for k in g})

    later = tuple(params) if deferred is None else deferred  # the keys whose reduction waits a layer

    def split(dw):  # (the part of a layer's gradient reduced now, the part reduced beside the next layer)
        return {k: v for k, v in dw.items() if k not in later}, {k: v for k, v in dw.items() if k in later}

    def layer(w, x, places, i):
        return fn(w, x, places.at_layer(i))[0]

    def forward(p, x, places, indices):
        def one(x, xs):
            return layer(whole(xs[0]), x, places, xs[1]), x
        return jax.lax.scan(one, x, (p, indices))

    @jax.custom_vjp
    def loop(p, x, places, indices):
        return forward(p, x, places, indices)[0]

    def loop_fwd(p, x, places, indices):
        y, inputs = forward(p, x, places, indices)
        return y, (p, inputs, places, indices)

    def loop_bwd(saved, dy):
        p, inputs, places, indices = saved
        count = jax.tree.leaves(p)[0].shape[0]

        def pull(i, dy):  # (dx, layer i's whole gradient); the stacks read in place (a slice of one is a
            # copy: the saved inputs of 31 layers again, 4.6 GiB a chip at Llama-3-8B's 16,384 tokens)
            w, x, index = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                                       (p, inputs, indices))
            dw, dx = jax.vjp(lambda w, x: layer(w, x, places, index), whole(w), x)[1](dy)
            return dx, dw

        def put(grads, i, g):  # g's keys of `grads` with their slot i set to g reduced
            return {**grads, **jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0),
                                            {k: grads[k] for k in g}, reduced(g))}

        def one(carry, i):  # layer i's backward, and layer i + 1's deferred gradient reduce-scattered beside it
            dy, pending, grads = carry
            dx, dw = pull(i, dy)
            now, later_dw = split(dw)
            return (dx, later_dw, put(put(grads, i + 1, pending), i, now)), None

        dx, dw = pull(count - 1, dy)
        now, pending = split(dw)
        grads = put(jax.tree.map(jnp.zeros_like, p), count - 1, now)
        (dx, pending, grads), _ = jax.lax.scan(one, (dx, pending, grads), jnp.arange(count - 2, -1, -1))
        return put(grads, 0, pending), dx, None, None

    loop.defvjp(loop_fwd, loop_bwd)
    return jax.shard_map(loop, mesh=layout.mesh_here(), in_specs=(specs, tokens, tokens, P()),
                         out_specs=tokens, axis_names=set(axes), check_vma=False)(inward, x_BLD, places, indices)
