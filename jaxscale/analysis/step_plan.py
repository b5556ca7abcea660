"""The plan of one compiled train step (a jaxscale.analysis.plan_types.Plan): per-device memory in
rows that add up to the program's peak (beside the state's arithmetic), the collectives by kind
and by the mesh axes they run over, matmul FLOPs, the pipeline's table. `python -m jaxscale.plan`
prints it; the layout search prices it (jaxscale.analysis.cost)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxscale import state as state_lib
from jaxscale.analysis import hlo_stats, overlap
from jaxscale.analysis.plan_types import (
    CompiledBytes,
    ExpectedRun,
    Flops,
    HostBytes,
    KindTotal,
    MemoryRows,
    PipelineSummary,
    Plan,
    StateBytes,
    by_axis,
)
from jaxscale.analysis.state_bytes import expected_bytes, param_counts
from jaxscale.build import build
from jaxscale.offload import HOST
from jaxscale.parallel import schedules


def shard_bytes(tree, memory_kind: str | None = None) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs/arrays (the first device's
    shard); only the leaves in `memory_kind` memory when given."""
    def one(x):
        return math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return sum(one(x) for x in jax.tree.leaves(tree)
               if memory_kind is None or x.sharding.memory_kind == memory_kind)


def compile_plan(config, platform: str, devices=None):
    """(the run, its train step compiled for `platform`, compile seconds), allocating nothing."""
    run = build(config, devices, platform)
    compiled, seconds = run.compile()
    return run, compiled, seconds


def compiled_bytes(run, compiled) -> MemoryRows:
    """Per-device bytes of the compiled train step, in rows that add up to its peak ("total"):
    the parameters and optimizer state (from the step's own input shardings), the rest of its
    arguments (the batch, step, key and guard), its temporaries, and the outputs that do not
    reuse a donated argument's buffer. "grads" is part of the temporaries, not another row: the
    gradients at the shardings the step constrains them to (ZeRO-2 splits them over data)."""
    memory = compiled.memory_analysis()
    state = state_lib.with_shardings(run.abstract_state, compiled.input_shardings[0][0])
    params, opt_state, frozen = shard_bytes(state.params), shard_bytes(state.opt_state), shard_bytes(state.base)
    grads = state_lib.with_shardings(run.abstract_state.params, run.step_spec.grad_shardings)
    other_args = memory.argument_size_in_bytes - params - opt_state - frozen
    temp, outputs = memory.temp_size_in_bytes, memory.output_size_in_bytes - memory.alias_size_in_bytes
    total = params + opt_state + frozen + other_args + temp + outputs
    return MemoryRows(params, opt_state, other_args, temp, outputs, total, shard_bytes(grads), frozen)


def _table(run):
    """The schedule table the step runs, or None without a pipeline."""
    strategy = run.model.spec.strategy
    return None if strategy.pipeline == "none" else strategy.table()


def _pipeline_summary(run, table) -> PipelineSummary:
    """The schedule's table, summarised: bubble and microbatches in flight per stage (both from
    the table the step runs), and its drawing (stages x ticks, F B W or . per tick)."""
    if table is None:
        return PipelineSummary(stages=1)
    return PipelineSummary(stages=table.stages, schedule=run.model.spec.strategy.pipeline,
                           microbatches=table.microbatches, virtual_stages=table.virtual, ticks=table.ticks,
                           bubble_fraction=table.bubble(), in_flight=tuple(table.in_flight().tolist()),
                           drawing=table.draw())


def describe(config, run, compiled, compile_s: float) -> Plan:
    """The plan of a compiled train step (`compile_plan`'s result)."""
    memory, state, mesh = compiled.memory_analysis(), run.abstract_state, run.layout.mesh.shape
    table = _table(run)
    # the pipeline executor's switch runs each action kind for the table's share of its ticks
    shares = {} if table is None else {schedules.ACTIONS: table.shares()}
    computations, entry = hlo_stats.parse_module(compiled.as_text(), shares)
    totals, expected = (hlo_stats.module_totals(computations, entry, e) for e in (False, True))
    windows = overlap.windows(computations, entry, mesh)
    return Plan(
        mesh=dict(mesh), zero_stage=run.layout.zero_stage, remat=config.model.remat,
        pipeline=_pipeline_summary(run, table), platform=run.platform, compute_dtype=str(run.step_spec.dtype),
        num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(state.weights)), compile_s=round(compile_s, 2),
        frozen="base" if run.model.spec.lora.on else "reference" if run.step_spec.keeps_reference else "",
        per_device_bytes=compiled_bytes(run, compiled), argument_bytes=memory.argument_size_in_bytes,
        compiled_bytes=CompiledBytes(memory.argument_size_in_bytes, memory.output_size_in_bytes,
                                     memory.temp_size_in_bytes, memory.alias_size_in_bytes,
                                     memory.generated_code_size_in_bytes),
        host_bytes=HostBytes(shard_bytes(state.params, HOST), shard_bytes(state.opt_state, HOST)),
        expected_bytes=StateBytes(**expected_bytes(param_counts(run.model), mesh, run.layout.zero_stage)),
        collectives={kind: KindTotal(**row) for kind, row in totals.collectives.items()},
        collectives_by_axis=by_axis(totals.by_axis(mesh)),
        flops=_flops(run, None if totals.convolutions else totals.dot_flops, config),
        # what one step is expected to run: each conditional's branches by their share
        expected=ExpectedRun(None if expected.convolutions else expected.dot_flops, by_axis(expected.by_axis(mesh))),
        overlap=overlap.by_axis(windows), windows=windows,
        notes=tuple(run.notes))


def _flops(run, compiled_flops: int | None, config) -> Flops:
    """Matmul FLOPs per device per step: the compiled program's (loops multiplied, remat's
    recompute included) beside the PaLM formula's share of one device; their ratio shows
    recomputation and work repeated across devices. None where the program writes its matmuls
    as convolutions (the TPU compiler), which the count does not read."""
    formula = run.flops_per_token * config.train.global_batch_size * config.train.seq_len / run.layout.mesh.size
    return Flops(compiled_flops, formula, compiled_flops / formula if formula and compiled_flops is not None else None)
