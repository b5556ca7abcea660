"""Parallelism beyond what sharding rules express: context-parallel attention, pipelines."""

import jax


def current_mesh(mesh):
    """The mesh a shard_map should name here: inside another shard_map (gradient accumulation
    over `data`, a pipeline stage), the context's abstract mesh, whose manual axes it inherits."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
