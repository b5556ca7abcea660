"""Reduce-scatters that stay reduce-scatters on a TPU torus.

Over a group of devices that spans more than one dimension of a TPU slice (a 128-chip axis of a
v5p-256 spans all three of its 4x4x8 torus, a 256-chip one of a v5e-256 both of its 16x16),
the TPU compiler writes a reduce-scatter as an all-reduce of the whole operand and a slice of
it: twice the bytes on the links, and the whole operand in memory. Written as one
reduce-scatter per dimension of the torus the group spans, each over a ring of that dimension,
every stage stays a reduce-scatter (measured with libtpu 0.0.42.1 and 0.0.52), and the stages
together send what one ring would: (n-1)/n of the operand. The first stage runs over the
slowest-varying dimension, so that each device ends with the block a single reduce-scatter
would give it.

The stages come from the devices' coordinates (`Device.coords`, TPUs only); anything else, a
group whose order walks the torus some other way, or one spanning slices, gets the plain
reduce-scatter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

Stages = tuple[tuple[tuple[int, ...], ...], ...]  # axis_index_groups of each stage, in order


def _along(mesh, axes: tuple[str, ...]) -> list:
    """The devices of the group along `axes` that holds the first device, in the group's index
    order (the first axis the slowest)."""
    names = list(mesh.axis_names)
    grid = mesh.devices[tuple(slice(None) if name in axes else 0 for name in names)]
    kept = [name for name in names if name in axes]
    return list(np.transpose(grid, [kept.index(a) for a in axes]).reshape(-1))


def _radices(coords: np.ndarray) -> list[int] | None:
    """How the group's index walks the torus, fastest first: runs of devices that differ in one
    physical dimension, each run a translate of the first. None when it walks otherwise."""
    radices, seq = [], coords
    while len(seq) > 1:
        moved = np.flatnonzero(seq[1] != seq[0])
        if len(moved) != 1:
            return None
        rest = np.delete(seq, moved[0], axis=1)
        run = 1
        while run < len(seq) and np.array_equal(rest[run], rest[0]):
            run += 1
        if len(seq) % run:
            return None
        blocks = seq.reshape(len(seq) // run, run, -1)
        if not np.array_equal(blocks - blocks[:, :1], np.broadcast_to(blocks[:1] - blocks[:1, :1], blocks.shape)):
            return None
        radices.append(run)
        seq = blocks[:, 0]
    return radices


def _groups(radices: list[int]) -> Stages:
    """axis_index_groups of one reduce-scatter per radix, the slowest first."""
    n, stages = math.prod(radices), []
    for i in reversed(range(len(radices))):
        stride = math.prod(radices[:i])
        firsts = [k for k in range(n) if (k // stride) % radices[i] == 0]
        stages.append(tuple(tuple(k + j * stride for j in range(radices[i])) for k in firsts))
    return tuple(stages)


@functools.cache
def _stages_cached(mesh, axes: tuple[str, ...]) -> Stages:
    devices = _along(mesh, axes)
    if len(devices) < 2 or devices[0].platform != "tpu" or not hasattr(devices[0], "coords"):
        return ()
    radices = _radices(np.array([d.coords for d in devices]))
    return _groups(radices) if radices and len(radices) > 1 else ()


def stages(mesh, axes: tuple[str, ...]) -> Stages:
    """The reduce-scatter over `axes` of `mesh` as stages over rings of the torus (see the
    module docstring); () for one plain reduce-scatter."""
    if mesh is None or not axes or not hasattr(mesh, "devices"):
        return ()
    return _stages_cached(mesh, tuple(axes))


def reduce_scatter(x, axes: tuple[str, ...], dim: int, plan: Stages = ()):
    """psum_scatter of x over `axes` along `dim` (tiled), in the stages of `plan`. The stages
    scatter x's first dimension: along a minor one, the last stage's blocks are narrower than a
    TPU tile (32 of 4096 columns on 128 chips) and the compiler wrote that stage as an all-reduce."""
    if not plan:
        return jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    x = jnp.moveaxis(x, dim, 0)
    for groups in plan:
        x = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True, axis_index_groups=[list(g) for g in groups])
    return jnp.moveaxis(x, 0, dim)
