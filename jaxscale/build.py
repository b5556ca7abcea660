"""One builder: (config, devices, platform) -> the frozen description of a run.

    run = build(config)                        # validated; nothing allocated, nothing compiled
    state = run.init_state()                   # each device creates only its own shards
    compiled, seconds = run.compile()          # the train step ahead of time
    state, metrics = compiled(state, batch)

The loop, the planner, `Trainer`, the tests and the benchmarks all build runs here. The data
pipeline is not part of a run (planning reads no data): the loop makes it from `run.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from jaxscale import determinism, preference
from jaxscale import state as state_lib
from jaxscale.analysis import mfu
from jaxscale.guard import GuardSpec
from jaxscale.mesh import granule_count
from jaxscale.models import LanguageModel, model_from_config
from jaxscale.offload import OffloadSpec, check_supported, to_device_kind
from jaxscale.optim import make_optimizer
from jaxscale.preference import PreferenceSpec
from jaxscale.runtime import program_cache, xla_flags
from jaxscale.sharding import Layout, layout_from_config
from jaxscale.state import TrainState
from jaxscale.step import StepSpec, jit_eval_step, jit_train_step
from jaxscale.validate import validate


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """Everything a run is built from, fixed before the first step. What changes while it trains
    (the state, the data position, counters) is held by the loop, not here."""

    config: object               # ml_collections.FrozenConfigDict: read anywhere, changed nowhere
    platform: str                # the platform the step is built for (may differ from this host's when planning)
    layout: Layout
    model: LanguageModel         # with its parallel strategy for this layout
    offload: OffloadSpec
    step_spec: StepSpec          # model, optimizer, schedule, layout, state shardings, dtype, accumulation, guard
    abstract_state: TrainState   # ShapeDtypeStructs carrying their shardings: compile, plan and restore targets
    notes: tuple[str, ...]       # one-line explanations of choices and adjustments
    flops_per_token: float
    peak_tflops: float | None

    @property
    def shardings(self) -> TrainState:
        return self.step_spec.state_shardings

    @property
    def guard(self) -> GuardSpec:
        return self.step_spec.guard

    @property
    def devices(self) -> list:
        """The run's devices in the mesh's order."""
        return list(self.layout.mesh.devices.flat)

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.layout.batch_sharding()

    @functools.cached_property
    def train_step(self):
        """jitted (state, batch) -> (state, metrics); the old state is donated."""
        return jit_train_step(self.step_spec)

    @functools.cached_property
    def eval_step(self):
        """jitted (params, batch) -> mean loss."""
        return jit_eval_step(self.step_spec)

    def batch_shape(self, keys: tuple[str, ...] | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """The abstract global batch the train step takes: `keys` (Data.keys), else {'inputs',
        'targets'} (and 'segments', the document ids, with data.document_mask; 'mask', the
        completions' tokens, under preference tuning)."""
        t = self.config.train
        tokens = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), np.int32, sharding=self.batch_sharding)
        if keys is None:
            keys = ("inputs", "targets", *(("segments",) if self.config.data.document_mask else ()),
                    *(("mask",) if self.step_spec.preference.on else ()))
        return dict.fromkeys(keys, tokens)

    def compile(self, keys: tuple[str, ...] | None = None):
        """(the train step compiled ahead of time for batches of `keys` (see batch_shape), seconds
        it took): step times never include it."""
        start, args = time.perf_counter(), (self.abstract_state, self.batch_shape(keys))
        key = program_cache.key("train_step", self.config, self.devices, *args)
        compiled, _ = program_cache.load_or_compile(key, lambda: self.train_step.lower(*args))
        return compiled, time.perf_counter() - start

    def init_state(self, params: dict | None = None) -> TrainState:
        """A fresh state from train.seed (each device makes only its shards); given `params`
        (on their shardings), they replace the initialisation and are donated, not copied."""
        s = self.step_spec
        key = program_cache.key("init_state", self.config, self.devices, params)
        return state_lib.init(s.model, s.tx, self.config.train.seed, s.layout, s.guard, params, self.offload, key,
                              s.keeps_reference)[0]

    def device_params(self, params: dict) -> dict:
        """`params` in device memory (a copy when they are offloaded to the host)."""
        if not self.offload.params:
            return params
        return jax.device_put(params, to_device_kind(self.shardings.weights))


def build(config, devices=None, platform: str | None = None) -> Run:
    """Validate `config`, then describe its run on `devices` (default: all) for `platform`
    (default: this host's); nothing is allocated or compiled."""
    devices = list(devices or jax.devices())
    validate(config, len(devices), granule_count(devices))
    platform = platform or jax.default_backend()
    layout, notes = layout_from_config(config, devices)
    model, model_notes = _model(config, platform, layout)
    offload = OffloadSpec.from_config(config.offload)
    check_supported(offload, devices)
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    guard, tuning = GuardSpec.from_config(config.guard), PreferenceSpec.from_config(config)
    abstract, shardings = state_lib.abstract(model, tx, layout, guard, offload, preference.keeps_copy(tuning, model))
    spec = StepSpec(model, tx, schedule, layout, shardings, config.train.grad_accum_steps, guard,
                    determinism.compiler_options(config, platform)
                    + xla_flags.compiler_options(config.xla, platform, experts=model.spec.moe.num_experts > 0,
                                                 device_kind=devices[0].device_kind),
                    tuning)
    n = mfu.active_params(abstract.weights, model.spec)
    frozen = mfu.active_params(abstract.base, model.spec) if model.spec.lora.on else 0
    flops = mfu.flops_per_token(model.spec, n, config.train.seq_len, frozen, reference=tuning.needs_reference)
    return Run(config=ml_collections.FrozenConfigDict(config), platform=platform, layout=layout, model=model,
               offload=offload, step_spec=spec, abstract_state=abstract, notes=tuple(notes + model_notes),
               flops_per_token=flops,
               peak_tflops=config.metrics.peak_tflops or _table_peak(platform, devices))


def _model(config, platform: str, layout: Layout) -> tuple[LanguageModel, list[str]]:
    """The model for `platform` on `layout`. A kernel this host cannot compile (cuDNN attention
    when planning a GPU run on a CPU host) is replaced by XLA's, and a note says so."""
    model, notes = model_from_config(config, platform, layout)
    here = jax.default_backend()
    if model.spec.attention_impl == "cudnn" and here != "gpu":
        model = LanguageModel(dataclasses.replace(model.spec, attention_impl="xla"))
        notes = [f"attention: planned with the xla kernel (cuDNN's does not compile on this {here} host, "
                 "not even for compile-only GPUs: it needs the cuDNN library); on the GPU cuDNN flash "
                 "attention runs instead, and its temporaries are not in this plan"]
    return model, notes


def _table_peak(platform: str, devices) -> float | None:
    """The peak of the devices the run is built on, when they are the platform's own."""
    return mfu.peak_tflops(devices[0].device_kind) if devices[0].platform == platform else None
