"""Pure train and eval steps: mixed precision, in-graph gradient accumulation, jitted once.

    spec = StepSpec(model, tx, schedule, layout, state_shardings, accum_steps=4)
    step = jit_train_step(spec)          # (state, batch) -> (state, metrics); the old state donated
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import guard as guard_lib
from jaxscale import preference
from jaxscale import state as state_lib
from jaxscale.guard import GuardSpec
from jaxscale.models import LanguageModel, lora, moe
from jaxscale.models.vocab import IGNORE
from jaxscale.offload import has_host, on_device
from jaxscale.parallel import microbatch
from jaxscale.preference import PreferenceSpec
from jaxscale.sharding import Layout
from jaxscale.state import TrainState

Batch = dict[str, jax.Array]  # {'inputs', 'targets'} (+ 'segments', 'mask'): int32 [B, L]; 'seeds': see with_seeds


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """Everything a train or eval step is built from."""

    model: LanguageModel
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    layout: Layout
    state_shardings: TrainState          # where every leaf of the state lives (host memory too)
    accum_steps: int = 1                 # microbatches per step, accumulated in-graph
    guard: GuardSpec = GuardSpec()
    compiler_options: tuple = ()         # (name, value) pairs XLA compiles the steps with (determinism.py)
    preference: PreferenceSpec = PreferenceSpec()  # a loss on pairs of completions (jaxscale.preference)

    @property
    def dtype(self):
        """The compute dtype of the forward and backward (the model's: model.spec.weights)."""
        return self.model.spec.dtype

    @property
    def stat_shapes(self) -> dict[str, tuple[int, ...]]:
        """The metrics the loss reports beside `loss`: the model's statistics and, under preference
        tuning, its rewards (preference.METRICS)."""
        return {**self.model.stat_shapes, **self.preference.metric_shapes}

    @property
    def keeps_reference(self) -> bool:
        """Whether the state's frozen `base` is a copy of the starting parameters (preference.keeps_copy)."""
        return preference.keeps_copy(self.preference, self.model)

    @functools.cached_property
    def grad_shardings(self) -> dict:
        """Where gradients live after the backward pass: split over `data` from ZeRO stage 2."""
        return state_lib.grad_shardings(self.model, self.layout)

    @property
    def placement(self) -> TrainState | None:
        """The state's shardings when some leaves live in host memory (brought to the devices in
        the step), else None."""
        return self.state_shardings if has_host(self.state_shardings) else None


def trained(batch: Batch, pieces: int = 1) -> tuple[Batch, jax.Array | None]:
    """(batch, count) for a batch split into `pieces` whose losses are averaged. With a loss mask
    (batch['mask']: 1 where a target is trained), the batch without it, each untrained target
    IGNORE, and count the trained tokens of the whole batch over `pieces`: each piece divides the
    sum of its trained tokens' losses by count, so the pieces' mean is the mean over every trained
    token of the batch, however unevenly they fall. Without a mask, (batch, None): each piece's
    mean over its own tokens, all of them trained."""
    if "mask" not in batch:
        return batch, None
    keep = batch["mask"] > 0
    rest = {key: value for key, value in batch.items() if key != "mask"}
    count = jnp.maximum(jnp.sum(keep, dtype=jnp.float32), 1.0) / pieces  # no trained token: a zero loss
    return {**rest, "targets": jnp.where(keep, batch["targets"], IGNORE)}, count


def loss_fn(params: dict, batch: Batch, spec: StepSpec, count=None, base=None) -> tuple[jax.Array, dict]:
    """(training objective, metrics) of model.loss: the float32 parameters cast to the compute
    dtype where the model uses them, the loss in float32, activations placed by its strategy's
    layout; with `count` (see trained), the sum over the trained targets divided by it. With a
    frozen `base` (LoRA), `params` are the adapters and the model runs on both. Under preference
    tuning, the loss of the batch's pairs (jaxscale.preference) against the frozen reference."""
    weights = lora.merge(params, base) if base else params
    if spec.preference.on:
        return preference.loss(spec.preference, spec.model, weights, reference(params, base, spec), batch)
    return spec.model.loss(weights, batch["inputs"], batch["targets"], batch.get("segments"), count, batch.get("seeds"))


def reference(params: dict, base: dict, spec: StepSpec) -> dict:
    """The model a preference loss compares against, the one the run started from: the LoRA base
    with its adapters at zero, else the starting parameters the state keeps frozen (`base`)."""
    if not spec.model.spec.lora.on:
        return base
    return lora.merge(jax.tree.map(jnp.zeros_like, params), base)


def _grad_fn(spec: StepSpec, count=None, base=None):
    """(params, batch) -> (metrics of loss_fn, gradients of the training objective), none of
    the frozen `base`'s: it is a constant of the differentiated function."""
    value_and_grad = jax.value_and_grad(functools.partial(loss_fn, spec=spec, count=count, base=base), has_aux=True)

    def fn(params, batch):
        (_, metrics), grads = value_and_grad(params, batch)
        return metrics, grads

    return fn


def _accumulate(params, batch: Batch, spec: StepSpec, grad_shardings=None, count=None, base=None):
    """Mean (metrics, grads) over spec.accum_steps microbatches, summed in float32. With
    `grad_shardings`, each microbatch's gradients and the running sum are kept there."""
    grad_fn, shapes = _grad_fn(spec, count, base), {"loss": (), **spec.stat_shapes}

    def place(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    def add(carry, micro):
        metrics, grads = grad_fn(params, micro)
        return jax.tree.map(jnp.add, carry, (metrics, place(grads))), None

    zeros = ({name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()},
             place(jax.tree.map(jnp.zeros_like, params)))
    unit = 2 if spec.preference.on else 1  # a pair's two rows in one microbatch
    total = jax.lax.scan(add, zeros, microbatch.split_tree(batch, spec.accum_steps, unit))[0]
    return jax.tree.map(lambda x: x / spec.accum_steps, total)


def _accumulate_per_replica(params, batch: Batch, spec: StepSpec, count=None, base=None):
    """Accumulate inside shard_map over `data`: each replica sums its microbatch gradients
    locally and they are reduced across `data` once per step, not once per microbatch.
    Inside, the replica's rows stay split over the other batch axes (fsdp, expert) as usual.
    `count` (see trained) is the whole batch's over its pieces: a replica's share of it is
    count / data, so that the mean over replicas stays the mean over every trained token."""
    replicas = spec.layout.mesh.shape["data"]

    def local(params, batch, count, base):
        share = None if count is None else count / replicas
        return jax.lax.pmean(_accumulate(params, batch, spec, count=share, base=base), "data")

    # check_vma=False: gradients of the replicated params stay per-device until the pmean.
    return jax.shard_map(local, mesh=spec.layout.mesh, in_specs=(P(), spec.layout.rows_over("data"), P(), P()),
                         out_specs=P(), axis_names={"data"}, check_vma=False)(params, batch, count, base)


def loss_and_grads(params, batch: Batch, spec: StepSpec, base=None):
    """Mean metrics ('loss' and the router statistics, see loss_fn) and gradients over
    spec.accum_steps microbatches.

    ZeRO 0-1 keep whole gradients on every replica: each sums its microbatches locally and one
    all-reduce over `data` per step averages them. From ZeRO-2 gradients live split over `data`,
    and so does the running sum: each microbatch's gradients are reduced into it, so a device holds
    one microbatch's gradients and 1/data of the sum, not two whole copies. The price is a
    reduce-scatter per microbatch ((n-1)/n of the gradient bytes each) in place of one all-reduce
    per step (2(n-1)/n): the memory ZeRO-2 is chosen for, paid in bandwidth, as DeepSpeed's ZeRO-2
    and FSDP2's default do. Summing whole locally and reducing once, as ZeRO-2 did before, sends
    less but keeps the whole sum, which is what ZeRO-2 exists to avoid (benchmarks/results/memory.md,
    "ZeRO-2 under accumulation", has both measured)."""
    batch, count = trained(batch, spec.accum_steps)
    if spec.accum_steps == 1:
        return _grad_fn(spec, count, base)(params, batch)
    if spec.layout.zero_stage < 2 and spec.layout.mesh.shape["data"] > 1:  # one replica: nothing to reduce
        return _accumulate_per_replica(params, batch, spec, count, base)
    return _accumulate(params, batch, spec, spec.grad_shardings, count, base)


def _on_device(state: TrainState, spec: StepSpec) -> TrainState:
    """The state with offloaded leaves brought to device memory (unchanged without offload)."""
    if spec.placement is None:
        return state
    return dataclasses.replace(state, params=on_device(state.params, spec.placement.params),
                               opt_state=on_device(state.opt_state, spec.placement.opt_state),
                               base=on_device(state.base, spec.placement.base))


def with_seeds(batch: Batch, key, spec: StepSpec) -> Batch:
    """The batch with each token's LoRA dropout seed, uint32 [B, L] drawn from `key` (the step's)
    over the whole batch, when the model drops its adapters' inputs (model.lora.dropout; see
    models.lora), before it is split into microbatches, replicas or pipeline microbatches: each
    token keeps its seed wherever it is computed. Unchanged without dropout."""
    if not (spec.model.spec.lora.on and spec.model.spec.lora.dropout):
        return batch
    seeds = jax.random.bits(key, batch["inputs"].shape, jnp.uint32)
    return {**batch, "seeds": jax.lax.with_sharding_constraint(seeds, spec.layout.batch_sharding())}


def train_step(state: TrainState, batch: Batch, spec: StepSpec):
    """One optimizer update, unless the guard rejects it. Returns the new state and scalar metrics."""
    state = _on_device(state, spec)
    stats, grads = loss_and_grads(state.params, with_seeds(batch, state.rng, spec), spec, state.base)
    loss = stats.pop("loss")  # what remains: an MoE model's router statistics
    load = stats.pop(moe.LOAD, None)  # balancing by bias: each MoE layer's load per expert
    grads = jax.lax.with_sharding_constraint(grads, spec.grad_shardings)  # ZeRO-2: split over data
    grad_norm = optax.tree.norm(grads)
    accept, spike, guard_state = guard_lib.decide(spec.guard, state.guard, loss, grad_norm)
    updates, opt_state = spec.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if load is not None:
        params = moe.balance(params, load, spec.model.spec.moe.bias_rate)
    params, opt_state = guard_lib.select(accept, (params, opt_state), (state.params, state.opt_state))
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                     rng=jax.random.fold_in(state.rng, state.step), guard=guard_state, base=state.base)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": spec.schedule(state.step),
               "tokens": jnp.asarray(batch["targets"].size, jnp.int32), "spike": spike,
               "nonfinite_skips": guard_state["nonfinite"], "spike_skips": guard_state["spikes"], **stats,
               **({"trained_tokens": jnp.sum(batch["mask"] > 0, dtype=jnp.int32)} if "mask" in batch else {})}
    return new, metrics


def jit_train_step(spec: StepSpec):
    """train_step jitted once with explicit shardings; the old state is donated. Outputs go back
    where the inputs came from: offloaded state returns to host memory."""
    replicated = NamedSharding(spec.layout.mesh, P())
    return jax.jit(functools.partial(train_step, spec=spec),
                   in_shardings=(spec.state_shardings, spec.layout.batch_sharding()),
                   out_shardings=(spec.state_shardings, replicated), donate_argnums=0,
                   compiler_options=dict(spec.compiler_options) or None)


def jit_eval_step(spec: StepSpec):
    """Validation metrics of one batch, (params, base, batch) -> {"loss": ...} (TrainState's
    params and frozen base): the mean cross entropy over its trained targets; under preference
    tuning the training's objective on the batch's pairs, against the same reference, with its
    rewards (jaxscale.preference.METRICS)."""
    s, names = spec.state_shardings, ("loss", *spec.preference.metric_shapes)

    def fn(params, base, batch):
        batch, count = trained(batch)
        metrics = loss_fn(on_device(params, s.params), batch, spec, count, on_device(base, s.base))[1]
        return {name: metrics[name] for name in names}

    replicated = NamedSharding(spec.layout.mesh, P())
    return jax.jit(fn, in_shardings=(s.params, s.base, spec.layout.batch_sharding()), out_shardings=replicated,
                   compiler_options=dict(spec.compiler_options) or None)
