"""Parallelism beyond what sharding rules express: context-parallel attention, pipelines."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def per_device(local, layout, q_BLHE, k_BLKE, v_BLKE, *rows_BL, every_axis: bool = False):
    """local(q, k, v, *rows) on the rows and heads each device holds: shard_map over `layout`'s
    batch and heads axes (none without a layout) (with `every_axis`, over every mesh axis not manual already:
    a Pallas kernel cannot sit where any axis is left to the partitioner, not even one of size 1;
    elsewhere that would add an all-reduce of each input's gradient over the size-1 axes).

    For attention kernels whose work is per row and head: the Pallas kernel, and the blockwise
    kernel, whose test for a tile nothing sees would otherwise be one all-reduce over the
    batch's axes per tile (measured on the TPU compiler). Key/value heads replicated across the
    heads' axes (too few to split) are repeated to one per query head first, so each device
    holds the pairs its query heads need."""
    if layout is None:
        return local(q_BLHE, k_BLKE, v_BLKE, *rows_BL)
    heads, batch, free = layout.axes("act_heads"), layout.batch_axes(), layout.free_axes()
    axes = free if every_axis else {*heads, *batch} & free
    if not axes:
        return local(q_BLHE, k_BLKE, v_BLKE, *rows_BL)
    if heads and heads != layout.axes("act_kv_heads"):
        groups = q_BLHE.shape[2] // k_BLKE.shape[2]
        k_BLKE, v_BLKE = (jnp.repeat(x, groups, axis=2) for x in (k_BLKE, v_BLKE))
    qkv, rows = P(batch or None, None, heads or None, None), P(batch or None, None)
    return jax.shard_map(local, mesh=layout.mesh_here(), in_specs=(qkv,) * 3 + (rows,) * len(rows_BL),
                         out_specs=qkv, axis_names=axes, check_vma=False)(q_BLHE, k_BLKE, v_BLKE, *rows_BL)
