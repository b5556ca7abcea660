"""Pure train and eval steps: mixed precision, in-graph gradient accumulation, jitted once."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale import guard as guard_lib
from jaxscale.guard import GuardSpec
from jaxscale.models import LanguageModel
from jaxscale.models.precision import compute_dtype  # noqa: F401  (re-exported for callers)
from jaxscale.offload import has_host, on_device
from jaxscale.parallel import microbatch
from jaxscale.parallel.context import AXIS as SEQUENCE, zigzag_order
from jaxscale.sharding import Layout
from jaxscale.state import TrainState

Batch = dict[str, jax.Array]  # {'inputs', 'targets'}: int32 [B, L]


def loss_fn(params: dict, batch: Batch, model: LanguageModel, dtype, layout: Layout) -> tuple[jax.Array, dict]:
    """(training objective, metrics): metrics['loss'] is the mean next-token cross entropy; an
    MoE model adds its router losses, weighted, to the objective and its router statistics
    (model.stat_names) to the metrics. The forward runs in `dtype`, the loss in float32."""
    cast = jax.tree.map(lambda p: p.astype(dtype), params)
    inputs, targets, positions = _sequence_layout(batch, layout)
    with layout.activate():  # activations are placed by the layout's rules while tracing
        logits_BLV, stats = model.apply_with_stats(cast, inputs, positions)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets).mean()
    return (loss + model.router_loss(stats) if stats else loss), {"loss": loss, **stats}


def _sequence_layout(batch: Batch, layout: Layout):
    """(inputs, targets, positions): in zig-zag order when the sequence is split over devices.

    Reordering tokens, targets and positions together leaves the model's function unchanged
    (RoPE and the causal mask follow positions) and the mean loss identical.
    """
    inputs, targets = batch["inputs"], batch["targets"]
    length, shards = inputs.shape[1], layout.mesh.shape[SEQUENCE]
    if shards == 1:
        return inputs, targets, None
    order = zigzag_order(length, shards)
    positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), inputs.shape)
    return inputs[:, order], targets[:, order], positions


def _grad_fn(model, dtype, layout: Layout):
    """(params, batch) -> (metrics of loss_fn, gradients of the training objective)."""
    value_and_grad = jax.value_and_grad(functools.partial(loss_fn, model=model, dtype=dtype, layout=layout),
                                        has_aux=True)

    def fn(params, batch):
        (_, metrics), grads = value_and_grad(params, batch)
        return metrics, grads

    return fn


def _accumulate(params, batch: Batch, grad_fn, count: int, names: tuple[str, ...]):
    """Mean (metrics, grads) over microbatches, summed in float32; `names` are the metrics'."""
    def add(carry, micro):
        return jax.tree.map(jnp.add, carry, grad_fn(params, micro)), None

    zeros = ({name: jnp.zeros((), jnp.float32) for name in names}, jax.tree.map(jnp.zeros_like, params))
    total = jax.lax.scan(add, zeros, microbatch.split_tree(batch, count))[0]
    return jax.tree.map(lambda x: x / count, total)


def _accumulate_per_replica(params, batch: Batch, model, dtype, count: int, layout: Layout):
    """Accumulate inside shard_map over `data`: each replica sums its microbatch gradients
    locally and they are reduced across `data` once per step, not once per microbatch.
    Inside, the replica's rows stay split over the other batch axes (fsdp, expert) as usual."""
    grad_fn, names = _grad_fn(model, dtype, layout), ("loss",) + model.stat_names

    def local(params, batch):
        return jax.lax.pmean(_accumulate(params, batch, grad_fn, count, names), "data")

    # check_vma=False: gradients of the replicated params stay per-device until the pmean.
    return jax.shard_map(local, mesh=layout.mesh, in_specs=(P(), P("data")), out_specs=P(),
                         axis_names={"data"}, check_vma=False)(params, batch)


def loss_and_grads(params, batch: Batch, model, dtype, accum_steps: int, layout: Layout):
    """Mean metrics ('loss' and the router statistics, see loss_fn) and gradients over
    `accum_steps` microbatches."""
    if accum_steps > 1 and layout.zero_stage < 3:
        return _accumulate_per_replica(params, batch, model, dtype, accum_steps, layout)
    grad_fn = _grad_fn(model, dtype, layout)
    if accum_steps == 1:
        return grad_fn(params, batch)
    # ZeRO-3: parameters are split over `data` too, so each microbatch gathers them; no shard_map.
    return _accumulate(params, batch, grad_fn, accum_steps, ("loss",) + model.stat_names)


def train_step(state: TrainState, batch: Batch, *, model, tx, schedule, dtype, accum_steps, layout, grad_shardings,
               guard: GuardSpec = GuardSpec(), placement: TrainState | None = None):
    """One optimizer update, unless the guard rejects it. Returns the new state and scalar metrics.
    `placement` (the state's shardings, when some live in host memory) brings them to the devices."""
    if placement is not None:
        state = dataclasses.replace(state, params=on_device(state.params, placement.params),
                                    opt_state=on_device(state.opt_state, placement.opt_state))
    stats, grads = loss_and_grads(state.params, batch, model, dtype, accum_steps, layout)
    loss = stats.pop("loss")  # what remains: an MoE model's router statistics
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)  # ZeRO-2: reduce-scatter, not all-reduce
    grad_norm = optax.tree.norm(grads)
    accept, spike, guard_state = guard_lib.decide(guard, state.guard, loss, grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params, opt_state = guard_lib.select(accept, (optax.apply_updates(state.params, updates), opt_state),
                                         (state.params, state.opt_state))
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                     rng=jax.random.fold_in(state.rng, state.step), guard=guard_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
               "tokens": jnp.asarray(batch["targets"].size, jnp.int32), "spike": spike,
               "nonfinite_skips": guard_state["nonfinite"], "spike_skips": guard_state["spikes"], **stats}
    return new, metrics


def jit_train_step(model, tx, schedule, dtype, accum_steps: int, layout: Layout,
                   state_shardings: TrainState, grad_shardings, guard: GuardSpec = GuardSpec()):
    """train_step jitted once with explicit shardings; the old state is donated."""
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, dtype=dtype,
                             accum_steps=accum_steps, layout=layout, grad_shardings=grad_shardings, guard=guard,
                             placement=state_shardings if has_host(state_shardings) else None)
    replicated = NamedSharding(layout.mesh, P())
    # Outputs go back where the inputs came from: offloaded state returns to host memory.
    return jax.jit(step, in_shardings=(state_shardings, layout.batch_sharding()),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)


def jit_eval_step(model, dtype, layout: Layout, params_shardings):
    """Mean validation loss (cross entropy) of one batch."""
    def fn(params, batch):
        return loss_fn(on_device(params, params_shardings), batch, model, dtype, layout)[1]["loss"]

    replicated = NamedSharding(layout.mesh, P())
    return jax.jit(fn, in_shardings=(params_shardings, layout.batch_sharding()), out_shardings=replicated)
