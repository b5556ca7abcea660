"""Pure train and eval steps: mixed precision, in-graph gradient accumulation, jitted once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.models import LanguageModel
from jaxscale.state import TrainState

Batch = dict[str, jax.Array]  # {'inputs', 'targets'}: int32 [B, L]


def compute_dtype(name: str, platform: str | None = None) -> jnp.dtype:
    """'auto' means bfloat16 on GPU/TPU and float32 on CPU, where bf16 matmuls are slow."""
    if name == "auto":
        platform = platform or jax.default_backend()
        return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def loss_fn(params: dict, batch: Batch, model: LanguageModel, dtype) -> jax.Array:
    """Mean next-token cross entropy; the forward runs in `dtype`, the loss in float32."""
    cast = jax.tree.map(lambda p: p.astype(dtype), params)
    logits_BLV = model.apply(cast, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()


def _microbatches(batch: Batch, count: int) -> Batch:
    """[B, L] -> [count, B/count, L], microbatch i = rows i, i+count, ...

    Strided rows keep every microbatch spread evenly over the shards of the batch dimension.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1), batch)


def _accumulate(params, batch: Batch, grad_fn, count: int):
    """Summed (loss, grads) over microbatches, in float32, without any cross-device reduction."""
    def add(carry, micro):
        return jax.tree.map(jnp.add, carry, grad_fn(params, micro)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(add, zeros, _microbatches(batch, count))[0]


def loss_and_grads(params, batch: Batch, model, dtype, accum_steps: int, batch_sharding: NamedSharding):
    """Mean loss and gradients over `accum_steps` microbatches.

    With accumulation, each data shard sums its microbatch gradients locally (shard_map over
    the `data` axis) and the sum is reduced across devices once per step, not per microbatch.
    """
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, model=model, dtype=dtype))
    if accum_steps == 1:
        return grad_fn(params, batch)
    mesh = batch_sharding.mesh

    def local(params, batch):
        total = _accumulate(params, batch, grad_fn, accum_steps)
        return jax.lax.pmean(jax.tree.map(lambda x: x / accum_steps, total), "data")

    # check_vma=False: gradients of the replicated params stay per-device until the pmean.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                         axis_names={"data"}, check_vma=False)(params, batch)


def train_step(state: TrainState, batch: Batch, *, model, tx, schedule, dtype, accum_steps, batch_sharding):
    """One optimizer update. Returns the new state and scalar metrics."""
    loss, grads = loss_and_grads(state.params, batch, model, dtype, accum_steps, batch_sharding)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state, rng=jax.random.fold_in(state.rng, state.step))
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step),
               "tokens": jnp.asarray(batch["targets"].size, jnp.int32)}
    return new, metrics


def jit_train_step(model, tx, schedule, dtype, accum_steps: int, state_shardings: TrainState,
                   batch_sharding: NamedSharding):
    """train_step jitted once with explicit shardings; the old state is donated."""
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, dtype=dtype,
                             accum_steps=accum_steps, batch_sharding=batch_sharding)
    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)


def jit_eval_step(model, dtype, params_shardings, batch_sharding: NamedSharding):
    """Mean validation loss of one batch."""
    fn = functools.partial(loss_fn, model=model, dtype=dtype)
    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(fn, in_shardings=(params_shardings, batch_sharding), out_shardings=replicated)
