"""TrainState and its construction: abstract shapes -> shardings -> jit(init, out_shardings).

The state is never built unsharded: each device creates only its own shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale import sharding as shd
from jaxscale.models import LanguageModel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array        # int32 scalar: optimizer updates applied so far
    params: dict           # float32 master parameters
    opt_state: Any         # optax state; each moment shaped and sharded like its parameter
    rng: jax.Array         # uint32[2] key for stochastic layers, advanced every step


def create(model: LanguageModel, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """The initial state; a pure function of the seed (independent of the mesh)."""
    params_key, rng = jax.random.split(jax.random.PRNGKey(seed))
    params = model.init(params_key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng)


def shardings(model: LanguageModel, tx: optax.GradientTransformation, mesh: Mesh,
              rules=shd.DEFAULT_RULES) -> TrainState:
    """NamedShardings for every leaf of the state, from the model's logical axes."""
    abstract = jax.eval_shape(lambda: create(model, tx, 0))
    replicated = NamedSharding(mesh, P())
    params = shd.named(mesh, shd.tree_specs(model.axes, mesh, rules))
    opt_state = optax.tree_map_params(tx, lambda _, s: s, abstract.opt_state, params,
                                      transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=params, opt_state=opt_state, rng=replicated)


def abstract(model: LanguageModel, tx: optax.GradientTransformation, mesh: Mesh,
             rules=shd.DEFAULT_RULES) -> TrainState:
    """The state as sharded ShapeDtypeStructs: for compiling and planning without allocating."""
    shapes = jax.eval_shape(lambda: create(model, tx, 0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings(model, tx, mesh, rules))


def init(model: LanguageModel, tx: optax.GradientTransformation, seed: int, mesh: Mesh,
         rules=shd.DEFAULT_RULES) -> tuple[TrainState, TrainState]:
    """(state, its shardings): compiled once, each device materialises only its shards."""
    out = shardings(model, tx, mesh, rules)
    state = jax.jit(create, static_argnums=(0, 1, 2), out_shardings=out)(model, tx, seed)
    return state, out
