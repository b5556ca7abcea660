"""The layers of a layer pattern's periods (models.families.period), as Transformer._loop runs
them: the stacked parameters (or caches) cut into whole periods and the rest, the caches of
the two joined again, and a layer kept in turn under full remat.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split(tree, groups: int, n: int):
    """(the first groups x n layers of the stacked `tree` as [groups, n, ...], the layers after them)."""
    return (jax.tree.map(lambda a: a[:groups * n].reshape(groups, n, *a.shape[1:]), tree),
            jax.tree.map(lambda a: a[groups * n:], tree))


def after_cotangent(layer):
    """layer(params, x, places, remat=False) fully rematerialised by a custom VJP: the forward saves
    its inputs, the backward runs the layer again and pulls the cotangent back, starting only once
    the output's cotangent exists (an optimization barrier on it and the inputs)."""
    @jax.custom_vjp
    def run(params, x, places):
        return layer(params, x, places, remat=False)

    def forward(params, x, places):  # through `run`, not `layer`: 15.8 GiB against 16.3 (Transformer._in_turn)
        return run(params, x, places), (params, x, places)

    def backward(inputs, dy):
        dy, inputs = jax.lax.optimization_barrier((dy, inputs))
        return jax.vjp(lambda *a: layer(*a, remat=False), *inputs)[1](dy)

    run.defvjp(forward, backward)
    return run


def joined(head: dict, tail: dict) -> dict:
    """{stack: head's layers, then tail's} of two caches' stacks, either of which may lack one."""
    return {name: jax.tree.map(lambda h, t: jnp.concatenate([h, t]), head[name], tail[name])
            if name in head and name in tail else head.get(name, tail.get(name)) for name in {**head, **tail}}
