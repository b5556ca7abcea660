"""CLI: python -m jaxscale.plan --config=PATH [--config.a.b=v ...] [--json] [--device_memory_gb=80]
    [--platform=gpu | --topology=v5p-256]

Compiles the real train step ahead of time for the configured mesh, allocating nothing (on fake
CPU devices when the target hardware is absent: XLA_FLAGS=--xla_force_host_platform_device_count=N),
and reports per device: parameter, gradient, optimizer and temporary bytes from the compiled
program beside the arithmetic for the layout and ZeRO stage, and the collectives per step (by
kind, and by the mesh axes they run over with the bytes each device sends).
`--topology` compiles for a TPU pod slice with the TPU compiler itself (libtpu's compile-only
client, on any host), or for H100/H200 hosts with XLA's GPU compiler (the CUDA plugin against a
described target, on any host), and checks the result against the devices' memory.
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp

from jaxscale import cli, profile, topology
from jaxscale import state as state_lib
from jaxscale.build import build
from jaxscale.errors import ConfigError
from jaxscale.models.moe import expert_param_count
from jaxscale.offload import HOST
from jaxscale.sharding import Layout
from jaxscale.step import jit_grad_step

USAGE = ("usage: python -m jaxscale.plan --config=PATH [--config.section.key=value ...] [--json] "
         "[--device_memory_gb=GB] [--platform=cpu|gpu|tpu "
         "| --topology=v5p-256|v5e-256|v6e-256|v4-128|2xv5e-256|h100-8|h200-16]")
GIB = 2**30


def shard_bytes(tree, memory_kind: str | None = None) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs/arrays (the first device's
    shard); only the leaves in `memory_kind` memory when given."""
    def one(x):
        return math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return sum(one(x) for x in jax.tree.leaves(tree)
               if memory_kind is None or x.sharding.memory_kind == memory_kind)


def expected_bytes(layer_params: int, other_params: int, layout: Layout, expert_params: int = 0) -> dict[str, float]:
    """The arithmetic: params 4N, grads 4N, Adam 8N, each divided by the devices that split it.

    `fsdp` and `tensor` split everything, `pipeline` the stacked layers, `expert` the expert
    weights (`expert_params` of the layer parameters); ZeRO adds `data` for optimizer state
    (stage >= 1), gradients (>= 2) and parameters (3).
    """
    shape, zero = layout.mesh.shape, layout.zero_stage
    layers = layer_params - expert_params + expert_params / shape["expert"]

    def per_device(bytes_per_param: int, stage: int) -> float:
        split = shape["fsdp"] * shape["tensor"] * (shape["data"] if zero >= stage else 1)
        return bytes_per_param * (layers / shape["pipeline"] + other_params) / split

    return {"params": per_device(4, 3), "grads": per_device(4, 2), "opt_state": per_device(8, 1)}


def compile_plan(config, platform: str, devices=None):
    """(the run, its train step compiled for `platform`, compile seconds), allocating nothing."""
    run = build(config, devices, platform)
    compiled, seconds = run.compile()
    return run, compiled, seconds


def compiled_bytes(run, compiled) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state as the compiler placed
    them: the state from the compiled step's input shardings, the gradients from the output
    shardings of the compiled gradient program (the backward pass and its reductions alone)."""
    state = state_lib.with_shardings(run.abstract_state, compiled.input_shardings[0][0])
    grads_program = jit_grad_step(run.step_spec).lower(run.abstract_state.params, run.batch_shape()).compile()
    grads = state_lib.with_shardings(run.abstract_state.params, grads_program.output_shardings)
    return {"params": shard_bytes(state.params), "grads": shard_bytes(grads), "opt_state": shard_bytes(state.opt_state)}


def _pipeline_summary(run) -> dict:
    """The schedule's table, summarised: bubble and microbatches in flight per stage (both from
    the table the step runs), and its drawing (stages x ticks, F B W or . per tick)."""
    strategy = run.model.spec.strategy
    if strategy.pipeline == "none":
        return {"stages": 1, "schedule": None, "microbatches": None, "virtual_stages": None, "bubble_fraction": 0.0}
    table = strategy.table()
    return {"stages": table.stages, "schedule": strategy.pipeline, "microbatches": table.microbatches,
            "virtual_stages": table.virtual, "ticks": table.ticks, "bubble_fraction": table.bubble(),
            "in_flight": table.in_flight().tolist(), "drawing": table.draw()}


def make_plan(config, platform: str | None = None, devices=None) -> dict:
    """The plan as a JSON-ready dict (see the module docstring), over `devices` (default: all)."""
    platform = platform or jax.default_backend()
    run, compiled, compile_s = compile_plan(config, platform, devices)
    memory, params = compiled.memory_analysis(), run.abstract_state.params
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    n_layers = sum(math.prod(x.shape) for x in jax.tree.leaves(params["layers"]))
    totals = profile.step_totals(compiled.as_text())
    per_device = {**compiled_bytes(run, compiled), "temp": memory.temp_size_in_bytes}
    # Peak: live arguments + temporaries + outputs that do not reuse a donated input.
    per_device["total"] = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                           + memory.output_size_in_bytes - memory.alias_size_in_bytes)
    state = run.abstract_state
    return {"mesh": dict(run.layout.mesh.shape), "zero_stage": run.layout.zero_stage,
            "pipeline": _pipeline_summary(run),
            "platform": platform, "compute_dtype": str(run.step_spec.dtype),
            "num_params": n_params, "compile_s": round(compile_s, 2), "per_device_bytes": per_device,
            "argument_bytes": memory.argument_size_in_bytes,
            "compiled_bytes": {"argument": memory.argument_size_in_bytes, "output": memory.output_size_in_bytes,
                               "temp": memory.temp_size_in_bytes, "alias": memory.alias_size_in_bytes,
                               "code": memory.generated_code_size_in_bytes},
            "host_bytes": {"params": shard_bytes(state.params, HOST), "opt_state": shard_bytes(state.opt_state, HOST)},
            "expected_bytes": expected_bytes(n_layers, n_params - n_layers, run.layout, expert_param_count(params)),
            "collectives": totals.collectives, "collectives_by_axis": totals.by_axis(run.layout.mesh.shape),
            "flops": _flops(run, None if totals.convolutions else totals.dot_flops, config),
            "notes": list(run.notes)}


def _flops(run, compiled_flops: int | None, config) -> dict:
    """Matmul FLOPs per device per step: the compiled program's (loops multiplied, remat's
    recompute included) beside the PaLM formula's share of one device; their ratio shows
    recomputation and work repeated across devices. None where the program writes its matmuls
    as convolutions (the TPU compiler), which the count does not read."""
    formula = run.flops_per_token * config.train.global_batch_size * config.train.seq_len / run.layout.mesh.size
    return {"compiled_per_device": compiled_flops, "formula_per_device": formula,
            "ratio": compiled_flops / formula if formula and compiled_flops is not None else None}


def advice(plan: dict, config, limit_bytes: float) -> list[str]:
    """Why it does not fit and what would help, biggest contributor first."""
    parts = {k: v for k, v in plan["per_device_bytes"].items() if k != "total"}
    order = sorted(parts, key=parts.get, reverse=True)
    lines = [f"does not fit: {_size(plan['per_device_bytes']['total'])} per device > {_size(limit_bytes)}; "
             f"biggest: " + ", ".join(f"{k} {_size(parts[k])}" for k in order[:3])]
    help_for = {
        "opt_state": f"raise zero_stage (now {config.zero_stage}) or mesh.fsdp to split optimizer state, or "
                     "offload.optimizer_state=True to keep it in host memory",
        "params": "zero_stage=3 or a larger mesh.fsdp / mesh.tensor splits parameters",
        "grads": "zero_stage>=2 or a larger mesh.fsdp splits gradients",
        "temp": f"model.remat=full (now {config.model.remat}), a larger train.grad_accum_steps "
                f"(now {config.train.grad_accum_steps}) or mesh.tensor with sharding.sequence_parallel=True "
                "shrink activations",
    }
    return lines + [f"  - {help_for[k]}" for k in order[:3]]


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def table(plan: dict) -> str:
    """The human-readable report."""
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1) or "1 device"
    if "topology" in plan:
        pod = plan["topology"]
        compiler = "TPU" if plan["platform"] == "tpu" else "GPU"
        mesh += f" on {pod['name']} ({pod['devices']} x {pod['device_kind']}, compiled by the {compiler} compiler)"
    rows = [f"plan: {plan['num_params'] / 1e6:,.1f}M params | mesh {mesh} | zero_stage={plan['zero_stage']} | "
            f"compute {plan['compute_dtype']} on {plan['platform']} | compiled in {plan['compile_s']}s",
            f"{'per device':<12}{'compiled':>14}{'arithmetic':>14}"]
    for key in ("params", "grads", "opt_state", "temp", "total"):
        expected = plan["expected_bytes"].get(key)
        shown = "" if expected is None else f"{_size(expected):>14}"
        rows.append(f"{key:<12}{_size(plan['per_device_bytes'][key]):>14}{shown}")
    host = plan.get("host_bytes", {})
    if any(host.values()):
        rows.append("in pinned host memory (offloaded; XLA:CPU counts it as device memory above): "
                    + ", ".join(f"{k} {_size(v)}" for k, v in host.items() if v))
    pipe = plan["pipeline"]
    if pipe["stages"] > 1:
        rows.append(f"pipeline: {pipe['schedule']}, {pipe['stages']} stages x {pipe['virtual_stages']} virtual x "
                    f"{pipe['microbatches']} microbatches in {pipe['ticks']} ticks: bubble "
                    f"{100 * pipe['bubble_fraction']:.1f}% of stage-ticks, microbatches in flight per stage "
                    f"{pipe['in_flight']}\n" + pipe["drawing"])
    if plan.get("memory_limit_bytes"):
        where = plan.get("topology", {}).get("name", plan["platform"])
        rows.append(f"{'fits' if plan['fits'] else 'does not fit'}: {_size(plan['per_device_bytes']['total'])} of "
                    f"{_size(plan['memory_limit_bytes'])} per device ({where})")
    flops = plan["flops"]
    compiled = ("not read (the program's matmuls are convolutions)" if flops["compiled_per_device"] is None else
                f"{flops['compiled_per_device'] / 1e12:,.3f} T compiled")
    rows.append(f"matmul FLOPs per device per step: {compiled}, {flops['formula_per_device'] / 1e12:,.3f} T by the "
                "formula" + ("" if flops["ratio"] is None else f" (ratio {flops['ratio']:.2f})"))
    rows.append("collectives per step:\n" + profile.summarize(plan["collectives"]))
    rows.append(_by_axis_table(plan["collectives_by_axis"]))
    rows += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(rows)


def _by_axis_table(by_axis: dict) -> str:
    """The collectives by the mesh axes they run over, with what each device sends."""
    rows = [f"{'collective':<20}{'over':<20}{'count':>8}{'MiB sent':>14}"]
    for kind, over in by_axis.items():
        rows += [f"{kind:<20}{axes:<20}{row['count']:>8}{row['sent_bytes'] / 2**20:>14.3f}"
                 for axes, row in over.items()]
    return "\n".join(rows)


def _device_limit(flag: float | None) -> float | None:
    if flag:
        return flag * GIB
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _target(flags: dict) -> tuple[str | None, list | None, float | None, dict]:
    """(platform, devices, memory limit per device, topology summary) the flags ask to plan for."""
    if not flags.get("topology"):
        return flags.get("platform"), None, _device_limit(flags.get("device_memory_gb")), {}
    platform = topology.parse(flags["topology"]).platform
    if flags.get("platform") not in (None, platform):
        raise ConfigError("--platform", flags["platform"], f"--topology plans for {platform}; drop one of the two")
    devices, pod = topology.compile_only_devices(flags["topology"])
    # The compile-only client compiles but cannot load executables: a persistent cache would
    # store them and then fail (a warning) to read them back.
    jax.config.update("jax_enable_compilation_cache", False)
    limit = flags["device_memory_gb"] * GIB if flags.get("device_memory_gb") else topology.hbm_per_device(pod, devices)
    return platform, devices, limit, {"name": pod.name, "slices": pod.slices, "chips_per_slice": pod.chips,
                                   "devices": len(devices), "device_kind": devices[0].device_kind}


def _plan(config, path: str, flags: dict) -> None:
    platform, devices, limit, pod = _target(flags)
    result = make_plan(config, platform, devices)
    if pod:
        result["topology"] = pod
    if limit:
        result["memory_limit_bytes"] = limit
        result["fits"] = result["per_device_bytes"]["total"] <= limit
    warnings = advice(result, config, limit) if limit and not result["fits"] else []
    result["warnings"] = warnings
    print(json.dumps(result, indent=2) if flags.get("json") else table(result))
    for line in warnings if not flags.get("json") else []:
        print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_plan, USAGE, {"json": bool, "device_memory_gb": float, "platform": str, "topology": str}, argv)


if __name__ == "__main__":
    sys.exit(main())
