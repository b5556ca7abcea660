"""Collective matmuls: sequence parallelism's gathers and reduce-scatters over `tensor` in ring steps,
each step's products computed while the next chunk travels.

In sequence-parallel mode a layer's normed input is split along its length over `tensor` and
its projections' weights along their heads (or hidden units). Written plainly, the input is
all-gathered along length before the first projection, and the output projection's partial sums
are reduce-scattered back along length after the last; each collective waits for, or holds up,
the matmul beside it. Here (`sharding.collective_matmul`) the gather is t - 1 collective permutes
of the length chunks, each chunk projected while the next one travels (`gathered`), and the
scatter t - 1 permutes of partial sums, each chunk's sum passed on while the next chunk's
product is computed (`scattered`). Their transposes, the backward pass's, are the same rings
run the other way. What runs inside is a shard_map manual over `tensor` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.sharding import Layout

AXIS = "tensor"


def wanted(setting: str, compiler: str) -> bool:
    """sharding.collective_matmul's answer for a step compiled for platform `compiler`: auto is on
    for the TPU compiler, which overlaps each ring step's permute with the products beside it, and
    off elsewhere: the GPU compiler's schedule exposed more with the rings than without (both
    measured from compiled plans: docs/planning.md)."""
    return setting == "on" or (setting == "auto" and compiler == "tpu")


def fits(layout: Layout) -> bool:
    """Whether layers on `layout` can run collective matmuls: `tensor` splits the residual
    stream's length (sequence parallelism) and the heads and hidden units the output projections
    contract over; not beside context parallelism, whose attention takes the whole of its length,
    nor in pipeline stages (on XLA:CPU a stage's permutes over `tensor` waited for devices of other
    stages, which never send them, and the step hung)."""
    shape = layout.mesh.shape
    return (shape[AXIS] > 1 and shape["pipeline"] == 1 and shape["sequence"] == 1
            and all(AXIS in layout.axes(name) for name in ("length", "act_heads", "act_mlp")))


def applies(layout: Layout | None) -> bool:
    """Whether a layer traced here, on a layout that `fits`, can run them: `tensor` is not manual here."""
    return layout is not None and AXIS in layout.free_axes()


def _spec(layout: Layout, names: Sequence[str | None]) -> P:
    """The PartitionSpec naming `tensor` wherever the logical axis `names[i]` is split over it."""
    return P(*(AXIS if name is not None and AXIS in layout.axes(name) else None for name in names))


def _map(body, layout: Layout, in_specs, out_specs):
    return jax.shard_map(body, mesh=layout.mesh_here(), in_specs=in_specs, out_specs=out_specs,
                         axis_names={AXIS}, check_vma=False)


def gathered(x_BLD, weights: Sequence[tuple[jax.Array, tuple[str, ...]]], dot: Callable, layout: Layout,
             out_names: Sequence[tuple[str, ...]]) -> tuple[jax.Array, ...]:
    """dot(x, w) for each (w, its logical axes) of `weights`, x [B, L, D] split along length over
    `tensor` (the residual stream's layout): each output [B, L, ...] whole along length and placed
    as its `out_names` say. Each device projects the chunk it holds, then each chunk it receives
    from its neighbour while passing it on: t chunks, t - 1 permutes."""
    t = layout.mesh.shape[AXIS]
    onward = [(j, (j - 1) % t) for j in range(t)]  # device j hands its chunk to j - 1

    def body(x, *ws):
        index, chunk = jax.lax.axis_index(AXIS), x.shape[1]
        outs = [None] * len(ws)
        for step in range(t):
            here = x
            if step < t - 1:
                x = jax.lax.ppermute(x, AXIS, onward)  # the next chunk travels during this step's products
            at = ((index + step) % t) * chunk  # device i holds chunk i + step at this step
            for i, w in enumerate(ws):
                y = dot(here, w)
                if outs[i] is None:
                    outs[i] = jnp.zeros((y.shape[0], chunk * t, *y.shape[2:]), y.dtype)
                outs[i] = jax.lax.dynamic_update_slice_in_dim(outs[i], y, at, axis=1)
        return tuple(outs)

    in_specs = (P(None, AXIS), *(_spec(layout, names) for _, names in weights))
    out_specs = tuple(_spec(layout, names) for names in out_names)
    return _map(body, layout, in_specs, out_specs)(x_BLD, *(w for w, _ in weights))


def scattered(h, w, dot: Callable, layout: Layout, h_names: tuple[str, ...], w_names: tuple[str, ...]):
    """dot(h, w) summed over `tensor` and split along length over it (the residual stream's
    layout): h [B, L, ...] whole along length and split over `tensor` in its contracted axes, as
    w's. Each device computes one chunk's partial product, adds it to the partial sum it receives
    and passes that on; after t - 1 permutes each holds its own chunk's sum."""
    t = layout.mesh.shape[AXIS]
    onward = [(j, (j + 1) % t) for j in range(t)]  # device j hands its partial sum to j + 1

    def body(h, w):
        index, chunk = jax.lax.axis_index(AXIS), h.shape[1] // t

        def part(step):  # device i adds chunk i - step - 1's product at this step; the last is its own
            at = ((index - step - 1) % t) * chunk
            return dot(jax.lax.dynamic_slice_in_dim(h, at, chunk, axis=1), w)

        total = part(0)
        for step in range(1, t):
            total = jax.lax.ppermute(total, AXIS, onward) + part(step)
        return total

    return _map(body, layout, (_spec(layout, h_names), _spec(layout, w_names)), P(None, AXIS))(h, w)
