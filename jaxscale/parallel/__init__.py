"""Parallelism beyond what sharding rules express: context-parallel attention, pipelines."""

import jax

from jaxscale import sharding


def current_mesh(mesh):
    """The mesh a shard_map should name here: inside another shard_map (gradient accumulation
    over `data`, a pipeline stage), the context's abstract mesh, whose manual axes it inherits."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh


def constrain(x, spec, mesh):
    """with_sharding_constraint to `spec` on `mesh`, stated on the context mesh inside shard_map."""
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(current_mesh(mesh), spec))


def batch_axes(*besides: str) -> tuple[str, ...]:
    """The mesh axes the active layout splits the batch over, less those already manual here and
    `besides`: the axes a shard_map over rows makes manual too, so that what each row needs
    stays on its device and gradients of what it shares are summed once, at the map's edge."""
    return tuple(a for a in sharding.split_axes("batch") if a not in besides)
