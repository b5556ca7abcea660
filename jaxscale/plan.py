"""CLI: python -m jaxscale.plan --config=PATH [--config.a.b=v ...] [--json] [--hlo=FILE] [--device_memory_gb=80]
    [--platform=gpu | --topology=v5p-256]

Compiles the real train step ahead of time for the configured mesh, allocating nothing (on fake
CPU devices when the target hardware is absent: XLA_FLAGS=--xla_force_host_platform_device_count=N),
and reports per device, from that one compiled program, rows that add up to its peak: parameters
and optimizer state (beside the arithmetic for the layout and ZeRO stage), the other inputs,
the temporaries (and the gradients among them) and the new outputs; and the collectives per
step (by kind, and by the mesh axes they run over with the bytes each device sends).
`--topology` compiles for a TPU pod slice with the TPU compiler itself (libtpu's compile-only
client, on any host), or for H100/H200 hosts with XLA's GPU compiler (the CUDA plugin against a
described target, on any host), and checks the result against the devices' memory.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

from jaxscale import cli
from jaxscale.analysis import cost, hlo_stats, machines, overlap, topology
from jaxscale.analysis.cost import Machine
from jaxscale.analysis.plan_types import ByAxis, Plan, TopologySummary, to_json
from jaxscale.analysis.step_plan import compile_plan, describe
from jaxscale.errors import ConfigError, RunError
from jaxscale.tracking.fields import flat_config

USAGE = ("usage: python -m jaxscale.plan --config=PATH [--config.section.key=value ...] [--json] [--hlo=FILE] "
         "[--device_memory_gb=GB] [--platform=cpu|gpu|tpu "
         "| --topology=v5p-256|v5e-256|v6e-256|v4-128|2xv5e-256|h100-8|h200-16] "
         "[--search [--tokens=1e12] [--top=10] [--compile=8] [--spread] [--budget_s=1200] [--workers=N] "
         "[--write=FILE]]")
GIB = 2**30


def plan_for(config, platform: str | None = None, devices=None) -> Plan:
    """The plan (see the module docstring) over `devices` (default: all)."""
    return describe(config, *compile_plan(config, platform or jax.default_backend(), devices))


def priced(plan: Plan, machine: Machine | None, dcn: dict[str, int] | None = None) -> Plan:
    """`plan` with its overlap's hidden and exposed bytes on `machine` and the step-time model's
    prediction there (unchanged without one)."""
    if machine is None:
        return plan
    def link(axes: str) -> float:
        return cost.link_speed(machine, axes, plan.mesh, dcn or {})
    return dataclasses.replace(plan, overlap=overlap.by_axis(plan.windows, machine, link),
                               predicted=cost.predict(plan.work, machine, dcn))


def make_plan(config, platform: str | None = None, devices=None) -> dict:
    """The plan as a JSON-ready dict, as `--json` prints it (`plan_for(...).to_json()`)."""
    return plan_for(config, platform, devices).to_json()


def advice(plan: Plan, config, limit_bytes: float) -> list[str]:
    """Why it does not fit and what would help, biggest contributor first."""
    rows = plan.per_device_bytes
    parts = {"params": rows.params, "opt_state": rows.opt_state, "temp": rows.temp}
    order = sorted(parts, key=parts.get, reverse=True)
    lines = [f"does not fit: {_size(rows.total)} per device > {_size(limit_bytes)}; "
             f"biggest: " + ", ".join(f"{k} {_size(parts[k])}" for k in order[:3])]
    help_for = {
        "opt_state": f"raise zero_stage (now {config.zero_stage}) or mesh.fsdp to split optimizer state, or "
                     "offload.optimizer_state=True to keep it in host memory",
        "params": "zero_stage=3 or a larger mesh.fsdp / mesh.tensor splits parameters",
        "temp": f"model.remat=full (now {config.model.remat}), a larger train.grad_accum_steps "
                f"(now {config.train.grad_accum_steps}) or mesh.tensor (sequence parallel by default) "
                "shrink activations",
    }
    return lines + [f"  - {help_for[k]}" for k in order[:3]]


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def table(plan: Plan) -> str:
    """The human-readable report."""
    mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.items() if v > 1) or "1 device"
    if plan.topology is not None:
        pod = plan.topology
        compiler = "TPU" if plan.platform == "tpu" else "GPU"
        mesh += f" on {pod.name} ({pod.devices} x {pod.device_kind}, compiled by the {compiler} compiler)"
    rows = [f"plan: {plan.num_params / 1e6:,.1f}M params | mesh {mesh} | zero_stage={plan.zero_stage} | "
            f"compute {plan.compute_dtype} on {plan.platform} | compiled in {plan.compile_s}s",
            f"{'per device':<16}{'compiled':>14}{'arithmetic':>14}"]
    lora = plan.frozen == "base"  # the adapters train; the arithmetic column is full training's
    labels = {"params": "adapters" if lora else "params", "opt_state": "opt_state",
              **({"frozen": f"frozen {plan.frozen}"} if plan.frozen else {}), "other_args": "other inputs",
              "temp": "temporaries", "grads": "  of which grads", "outputs": "outputs (new)", "total": "total"}
    for key, label in labels.items():
        expected = None if lora else getattr(plan.expected_bytes, key, None)
        shown = "" if expected is None else f"{_size(expected):>14}"
        rows.append(f"{label:<16}{_size(getattr(plan.per_device_bytes, key)):>14}{shown}")
    host = plan.host_bytes.to_json()
    if any(host.values()):
        rows.append("in pinned host memory (offloaded; XLA:CPU counts it as device memory above): "
                    + ", ".join(f"{k} {_size(v)}" for k, v in host.items() if v))
    pipe = plan.pipeline
    if pipe.stages > 1:
        rows.append(f"pipeline: {pipe.schedule}, {pipe.stages} stages x {pipe.virtual_stages} virtual x "
                    f"{pipe.microbatches} microbatches in {pipe.ticks} ticks: bubble "
                    f"{100 * pipe.bubble_fraction:.1f}% of stage-ticks, microbatches in flight per stage "
                    f"{list(pipe.in_flight)}\n" + pipe.drawing)
    if plan.memory_limit_bytes:
        where = plan.platform if plan.topology is None else plan.topology.name
        rows.append(f"{'fits' if plan.fits else 'does not fit'}: {_size(plan.per_device_bytes.total)} of "
                    f"{_size(plan.memory_limit_bytes)} per device ({where})")
    flops = plan.flops
    compiled = ("not read (the program's matmuls are convolutions)" if flops.compiled_per_device is None else
                f"{flops.compiled_per_device / 1e12:,.3f} T compiled")
    rows.append(f"matmul FLOPs per device per step: {compiled}, {flops.formula_per_device / 1e12:,.3f} T by the "
                "formula" + ("" if flops.ratio is None else f" (ratio {flops.ratio:.2f})"))
    rows.append("collectives per step:\n" + hlo_stats.summarize(to_json(plan.collectives)))
    rows.append(_by_axis_table(plan.collectives_by_axis))
    rows.append(_overlap_table(plan))
    if plan.predicted is not None:
        rows.append(_prediction_line(plan))
    rows += [f"note: {note}" for note in plan.notes]
    return "\n".join(rows)


def _by_axis_table(by_axis: ByAxis) -> str:
    """The collectives by the mesh axes they run over, with what each device sends."""
    rows = [f"{'collective':<20}{'over':<20}{'count':>8}{'MiB sent':>14}"]
    for kind, over in by_axis.items():
        rows += [f"{kind:<20}{axes:<20}{row.count:>8}{row.sent_bytes / 2**20:>14.3f}" for axes, row in over.items()]
    return "\n".join(rows)


def _overlap_table(plan: Plan) -> str:
    """What the schedule runs beside each axis group's collectives, and on a named target how
    much of them that hides."""
    on_target = plan.topology is not None
    rows = ["overlap (the compiled schedule: matmuls between each asynchronous collective's start and done)"
            + ("" if on_target else "; hidden and exposed bytes need a target's rates: --topology"),
            f"{'over':<20}{'MiB sent':>12}{'async':>8}{'TFLOP beside':>14}"
            + (f"{'hidden':>8}{'MiB exposed':>14}" if on_target else "")]
    for axes, row in plan.overlap.items():
        line = (f"{axes:<20}{row.sent_bytes / 2**20:>12.1f}{_share(row.async_bytes, row.sent_bytes):>8}"
                f"{row.flops_beside / 1e12:>14.3f}")
        if on_target and row.hidden_bytes is not None:
            line += f"{_share(row.hidden_bytes, row.sent_bytes):>8}{row.exposed_bytes / 2**20:>14.1f}"
        rows.append(line)
    return "\n".join(rows)


def _prediction_line(plan: Plan) -> str:
    p, ms = plan.predicted, 1e3
    return (f"predicted step on {plan.topology.name}: {p.step_s * ms:,.1f} ms (matmuls {p.compute_s * ms:,.1f}, "
            f"memory {p.memory_s * ms:,.1f}, collectives hidden {p.hidden_s * ms:,.1f} and exposed "
            f"{p.exposed_s * ms:,.1f} ms; jaxscale/analysis/cost.py at datasheet rates)")


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _device_limit(flag: float | None) -> float | None:
    if flag:
        return flag * GIB
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _target(flags: dict) -> tuple[str | None, list | None, float | None, TopologySummary | None, Machine | None]:
    """(platform, devices, memory limit per device, topology summary, its machine) the flags ask to plan for."""
    if not flags.get("topology"):
        return flags.get("platform"), None, _device_limit(flags.get("device_memory_gb")), None, None
    platform = topology.parse(flags["topology"]).platform
    if flags.get("platform") not in (None, platform):
        raise ConfigError("--platform", flags["platform"], f"--topology plans for {platform}; drop one of the two")
    devices, pod = topology.compile_only_devices(flags["topology"])
    # The compile-only client compiles but cannot load executables: a persistent cache would
    # store them and then fail (a warning) to read them back.
    jax.config.update("jax_enable_compilation_cache", False)
    limit = flags["device_memory_gb"] * GIB if flags.get("device_memory_gb") else topology.hbm_per_device(pod, devices)
    summary = TopologySummary(pod.name, pod.slices, pod.chips, len(devices), devices[0].device_kind)
    return platform, devices, limit, summary, machines.for_pod(pod, devices)


def _plan(config, path: str, flags: dict) -> None:
    if flags.get("search"):
        return _search(config, path, flags)
    platform, devices, limit, pod, machine = _target(flags)
    run, compiled, seconds = _compile(config, platform or jax.default_backend(), devices)
    if flags.get("hlo"):  # the compiled step's HLO, as the compiler optimised it
        with open(flags["hlo"], "w") as file:
            file.write(compiled.as_text())
    result = priced(dataclasses.replace(describe(config, run, compiled, seconds), topology=pod), machine)
    if limit:
        result = dataclasses.replace(result, memory_limit_bytes=limit, fits=result.per_device_bytes.total <= limit)
    warnings = advice(result, config, limit) if limit and not result.fits else []
    result = dataclasses.replace(result, warnings=tuple(warnings))
    print(json.dumps(result.to_json(), indent=2) if flags.get("json") else table(result))
    for line in warnings if not flags.get("json") else []:
        print(line, file=sys.stderr)


def _compile(config, platform: str, devices):
    """compile_plan, a compiler that runs out of device memory compiling the step (the TPU
    compiler does: it places every buffer) said in one line as the layout not fitting."""
    try:
        return compile_plan(config, platform, devices)
    except jax.errors.JaxRuntimeError as error:
        message = str(error).strip().splitlines()[0]
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        raise RunError(f"the layout does not fit: the {platform.upper()} compiler says {message}; split the "
                       "state further (mesh.fsdp, mesh.expert, mesh.tensor, zero_stage), remat (model.remat=full) "
                       "or fewer rows a device (train.global_batch_size, train.grad_accum_steps)") from None


def search_target(topology_name: str | None = None, memory_gb: float | None = None, devices=None):
    """The search's Target: a named topology (its datasheet), or this host's `devices` (default:
    all; measured)."""
    from jaxscale.analysis import search
    from jaxscale.mesh import granule_count

    if topology_name:
        devices, pod = topology.compile_only_devices(topology_name)
        machine = machines.for_pod(pod, devices)
        hosts = granule_count(devices)
        slices = pod.slices if pod.platform == "tpu" else hosts  # a TPU slice's hosts share its ICI
    else:
        devices = list(devices or jax.devices())
        if devices[0].platform != "cpu":
            raise ConfigError("--topology", "", f"name the {devices[0].platform.upper()}s to search for (e.g. "
                                                "--topology=h100-8 or v5p-256): their links come from the datasheet")
        machine = machines.calibrate_cpu(devices)
        slices = hosts = 1
    if memory_gb:
        machine = dataclasses.replace(machine, memory_bytes=memory_gb * GIB)
    return search.Target(topology_name, len(devices), slices, hosts, machine, tuple(devices))


def _search(config, path: str, flags: dict) -> None:
    from jaxscale.analysis import search

    target = search_target(flags.get("topology"), flags.get("device_memory_gb"))
    result = search.search(config, target, count=flags.get("compile") or 8, budget_s=flags.get("budget_s") or 1200.0,
                           workers=flags.get("workers"), spread=bool(flags.get("spread")))
    rows, top = result.rows, result.rows[:flags.get("top") or 10]
    if flags.get("json"):
        print(json.dumps(search.records(top, target, flags.get("tokens")), indent=2))
    else:
        print(f"search: {result.estimated} layouts fit by arithmetic; {len(rows)} compiled for "
              f"{target.machine.name} ({target.devices} devices)")
        print(search.table(top, target, flags.get("tokens")))
    for layout, why in result.failed:
        print(f"not compiled: {layout.describe()}: {why}", file=sys.stderr)
    best = search.best_overrides(rows)
    current = flat_config(config)
    changed = {k: v for k, v in best.items() if current[k] != v}
    if flags.get("write"):
        with open(flags["write"], "w") as file:
            json.dump(changed, file, indent=2)
    print("best: " + search.command_line(path, changed), file=sys.stderr if flags.get("json") else sys.stdout)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_plan, USAGE, {"json": bool, "hlo": str, "device_memory_gb": float, "platform": str,
                                   "topology": str, "search": bool, "tokens": float, "top": int, "compile": int,
                                   "budget_s": float, "workers": int, "write": str, "spread": bool}, argv)


if __name__ == "__main__":
    cli.exit_process(main())
