"""TrainState and its construction: abstract shapes -> shardings -> jit(init, out_shardings).

The state is never built unsharded: each device creates only its own shards.

With LoRA adapters (model.lora.rank > 0) `params` holds the adapters alone, the parameters the
optimizer updates and the gradients are taken of, and `base` the frozen rest of the model, with
no optimizer state and no gradients; `weights` is the whole tree the model runs on. With
`reference` (DPO without LoRA, jaxscale.preference) `base` is a frozen copy of the starting
parameters, split as they are, and `params` the whole model.

ZeRO over `data` (the `fsdp` axis always shards everything it is given by the rules):
stage 0 nothing more, 1 optimizer state, 2 + gradients, 3 + parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import guard as guard_lib
from jaxscale import sharding as shd
from jaxscale.guard import GuardSpec
from jaxscale.models import LanguageModel, lora
from jaxscale.offload import OffloadSpec, to_host
from jaxscale.runtime import program_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array        # int32 scalar: optimizer updates applied so far
    params: dict           # float32 master parameters
    opt_state: Any         # optax state; each moment shaped and sharded like its parameter
    rng: jax.Array         # uint32[2] key for stochastic layers, advanced every step
    guard: dict            # loss window and skip counters of the training guards (jaxscale.guard)
    base: dict = dataclasses.field(default_factory=dict)  # frozen parameters: LoRA's base, DPO's reference, or {}

    @property
    def weights(self) -> dict:
        """The model's whole parameter tree: the trained parameters with the frozen base."""
        return lora.merge(self.params, self.base) if self.base else self.params


def changing(state: TrainState) -> TrainState:
    """What a checkpoint holds of `state`: all of it but the frozen base (LoRA), which the run's
    base source (checkpoint.init_from, or the seed) gives back on resume."""
    return dataclasses.replace(state, base={}) if state.base else state


def base_target(abstract: TrainState) -> dict:
    """The frozen base's ShapeDtypeStructs in float32, as a base checkpoint stores parameters."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), abstract.base)


def trained_and_frozen(model: LanguageModel, tree: dict, reference: bool = False) -> tuple[dict, dict]:
    """(the part of a parameter-shaped tree that trains, the frozen part): with LoRA adapters
    (the adapters, the base), else (the whole tree, the whole tree again with `reference`, else {})."""
    if model.spec.lora.on:
        return lora.split(tree)
    return tree, (tree if reference else {})


def seeded_params(model: LanguageModel, seed: int) -> dict:
    """The parameters `create` draws from `seed` (train.seed)."""
    return model.init(jax.random.split(jax.random.PRNGKey(seed))[0])


def create(model: LanguageModel, tx: optax.GradientTransformation, seed: int, guard: GuardSpec = GuardSpec(),
           params: dict | None = None, reference: bool = False) -> TrainState:
    """The initial state; a pure function of the seed (independent of the mesh). Given `params`
    (e.g. loaded for fine-tuning), they replace the seeded initialisation: with LoRA adapters,
    `params` is the base (the adapters start from the seed), stored in lora.base_dtype. With
    `reference`, a frozen copy of the parameters is kept (trained_and_frozen)."""
    rng, spec = jax.random.split(jax.random.PRNGKey(seed))[1], model.spec.lora
    if params is None or spec.on:
        seeded = seeded_params(model, seed)
        params = seeded if params is None else lora.merge(lora.split(seeded)[0], params)
    params, base = trained_and_frozen(model, params, reference)
    base = jax.tree.map(lambda x: x.astype(spec.base_dtype), base)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                      guard=guard_lib.init(guard), base=base)


def param_specs(model: LanguageModel, layout: shd.Layout, over_data: bool) -> dict:
    """PartitionSpecs of parameter-shaped trees; over_data adds the ZeRO split over `data`."""
    def one(path, names, shape):
        return layout.param_spec(names, shape.shape, over_data, jax.tree_util.keystr(path))
    return jax.tree_util.tree_map_with_path(one, model.axes, model.shapes, is_leaf=lambda x: isinstance(x, tuple))


def grad_shardings(model: LanguageModel, layout: shd.Layout) -> dict:
    """Where gradients live after the backward pass: split over `data` from ZeRO stage 2."""
    return trained_and_frozen(model, shd.named(layout.mesh, param_specs(model, layout, layout.zero_stage >= 2)))[0]


def _shapes(model: LanguageModel, tx: optax.GradientTransformation, guard: GuardSpec, reference: bool) -> TrainState:
    return jax.eval_shape(lambda: create(model, tx, 0, guard, reference=reference))


def _shardings_of(shapes: TrainState, model: LanguageModel, tx: optax.GradientTransformation,
                  layout: shd.Layout, offload: OffloadSpec, reference: bool) -> TrainState:
    replicated = NamedSharding(layout.mesh, P())
    params, base = trained_and_frozen(model, shd.named(layout.mesh, param_specs(model, layout, layout.zero_stage >= 3)),
                                      reference)
    moments = trained_and_frozen(model, shd.named(layout.mesh, param_specs(model, layout, layout.zero_stage >= 1)))[0]
    params, base = (to_host(params), to_host(base)) if offload.params else (params, base)
    moments = to_host(moments) if offload.optimizer_state else moments
    opt_state = optax.tree_map_params(tx, lambda _, s: s, shapes.opt_state, moments,
                                      transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=params, opt_state=opt_state, rng=replicated,
                      guard=jax.tree.map(lambda _: replicated, shapes.guard), base=base)


def shardings(model: LanguageModel, tx: optax.GradientTransformation, layout: shd.Layout,
              guard: GuardSpec = GuardSpec(), offload: OffloadSpec = OffloadSpec(),
              reference: bool = False) -> TrainState:
    """NamedShardings for every leaf of the state, from the model's logical axes and the ZeRO
    stage; offloaded leaves in pinned host memory."""
    return _shardings_of(_shapes(model, tx, guard, reference), model, tx, layout, offload, reference)


def with_shardings(shapes, shardings_tree):
    """ShapeDtypeStructs carrying their shardings: a target to compile for or restore into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings_tree)


def abstract(model: LanguageModel, tx: optax.GradientTransformation, layout: shd.Layout,
             guard: GuardSpec = GuardSpec(), offload: OffloadSpec = OffloadSpec(),
             reference: bool = False) -> tuple[TrainState, TrainState]:
    """(the state as sharded ShapeDtypeStructs, its shardings): for compiling, planning and
    restoring without allocating."""
    shapes = _shapes(model, tx, guard, reference)
    out = _shardings_of(shapes, model, tx, layout, offload, reference)
    return with_shardings(shapes, out), out


def init(model: LanguageModel, tx: optax.GradientTransformation, seed: int, layout: shd.Layout,
         guard: GuardSpec = GuardSpec(), params: dict | None = None,
         offload: OffloadSpec = OffloadSpec(), cache_key: str | None = None,
         reference: bool = False) -> tuple[TrainState, TrainState]:
    """(state, its shardings): compiled once, each device materialises only its shards. Given
    `params` (already on their shardings) they are donated into the state, not copied. With a
    `cache_key` (jaxscale.runtime.program_cache) the compiled initialisation is loaded or kept whole."""
    out = shardings(model, tx, layout, guard, offload, reference)
    make = jax.jit(functools.partial(create, model, tx, seed, guard, reference=reference), out_shardings=out,
                   donate_argnums=0)
    if cache_key is None:
        return make(params), out
    program, _ = program_cache.load_or_compile(cache_key, lambda: make.lower(params))
    return program(params), out
