"""The layout chosen for you: enumerate, prune by arithmetic, compile the most promising, rank by
the step-time model.

    target = jaxscale.plan.search_target("v5p-256")     # or None: this host's CPU devices
    result = search(config, target)                     # ranked rows, and what did not compile
    print(table(result.rows, target, tokens=1e12))

1. Every layout the model and the devices allow (jaxscale.analysis.layouts.candidates) gets an
   arithmetic estimate: its memory per device and a predicted step time from its FLOPs and the
   collectives ring arithmetic expects, priced by the same model as compiled plans.
2. Those whose estimate fits the device's memory (with `MARGIN` for the estimate's error) are
   compiled, best estimate first, by the real compiler for the real target (TPU or GPU
   compile-only, or this host's devices), in worker processes where the host has the cores,
   until `count` have compiled or `budget_s` has passed. Pure FSDP over every device (the layout
   MaxText starts from) is compiled too, as the reference.
3. Each compiled plan is priced by jaxscale.analysis.cost from what the compiler wrote: memory
   from its buffers, FLOPs and each collective's bytes from its HLO; the rows are ranked, those
   that fit first, by predicted step time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import time

import jax
import ml_collections

from jaxscale.analysis import cost, layouts
from jaxscale.analysis.mfu import active_params, flops_per_token
from jaxscale.analysis.plan_types import Plan, StepWork
from jaxscale.analysis.state_bytes import param_counts
from jaxscale.errors import ConfigError
from jaxscale.names import AXES

MARGIN = 1.25  # an estimate may exceed the memory by this factor and still be compiled
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the search plans for: a topology name (None: this host's devices), its device count,
    the slices (TPU) or hosts (GPU) the data axis spans over the slow network, the hosts the job's
    processes run on, and the machine the cost model prices."""

    name: str | None
    devices: int
    slices: int
    hosts: int
    machine: cost.Machine
    device_list: tuple = ()  # the devices themselves, where a mesh's shape is checked


@dataclasses.dataclass(frozen=True)
class Row:
    layout: layouts.Candidate
    total_bytes: float          # compiled, per device
    fits: bool
    prediction: cost.Prediction
    tokens_per_s: float
    mfu: float | None
    sent_by_axis: dict[str, float]  # GiB a device sends per step, by mesh axes
    compile_s: float


def model_numbers(config) -> tuple[dict[str, int], float]:
    """(parameter counts by how they split, training FLOPs per token) from abstract shapes."""
    from jaxscale.models import model_from_config

    model, _ = model_from_config(config, "cpu")
    return param_counts(model), flops_per_token(model.spec, active_params(model.shapes, model.spec),
                                                config.train.seq_len)


def ranked_estimates(config, target: Target) -> list[tuple[float, layouts.Candidate, StepWork]]:
    """(predicted seconds, layout, estimate) of every candidate whose estimate fits, fastest first.
    Raises ConfigError (naming the topology) when none fits, with the devices the state needs."""
    counts, per_token = model_numbers(config)
    machine, found = target.machine, []
    for layout in layouts.candidates(config, target.devices, target.slices, machine.fast_domain):
        guess = layouts.estimate(config, layout, counts, per_token)
        if guess.per_device_bytes.total <= MARGIN * machine.memory_bytes:
            found.append((cost.predict(guess, machine).step_s, layout, guess))
    if not found:
        raise ConfigError("--topology", target.name or f"{target.devices} devices", _too_small(counts, target))
    found.sort(key=lambda item: (item[0], item[1].describe()))
    return found


def _too_small(counts: dict[str, int], target: Target) -> str:
    """The fix when nothing fits: the devices the training state alone needs (16 bytes a
    parameter: fp32 weights and gradients, Adam's two moments), spread over every axis."""
    n = counts["layers"] + counts["layer_vectors"] + counts["other"] + counts["vectors"]
    need = math.ceil(16 * n / target.machine.memory_bytes)
    return (f"no layout of {n / 1e9:.2f}B parameters fits {target.devices} devices of "
            f"{target.machine.memory_bytes / GIB:.1f} GiB: the state alone (16 bytes a parameter) needs at least "
            f"{need} devices, activations more; plan for a larger topology")


def _picked(ranked, config, target: Target, count: int, spread: bool = False) -> list[layouts.Candidate]:
    """The `count` best distinct layouts that validate, pure FSDP over every device, and with
    `spread` the best of each combination of split axes (one fsdp-and-tensor, one pipelined, ...)."""
    chosen, families = [], set()
    for _, layout, _ in ranked:
        family = frozenset(axis for axis, size in layout.mesh if size > 1)
        wanted = len(chosen) < count or (spread and family not in families)
        if wanted and layout not in chosen and _valid(config, layout, target):
            chosen.append(layout)
            families.add(family)
    baseline = fsdp_baseline(config, target)
    if baseline not in chosen and _valid(config, baseline, target):
        chosen.append(baseline)
    return chosen


def fsdp_baseline(config, target: Target) -> layouts.Candidate:
    """Pure FSDP over every device of a slice (data over the slices), ZeRO 0, the config's remat."""
    sizes = dict.fromkeys(AXES, 1)
    sizes.update(data=target.slices, fsdp=target.devices // target.slices)
    return layouts.Candidate(tuple(sizes.items()), target.slices, 0, config.model.remat)


def _valid(config, layout: layouts.Candidate, target: Target) -> bool:
    """Whether the layout passes the run's checks and its mesh can be laid on the devices (a TPU
    torus takes axes whose sizes are products of its dimensions)."""
    from jaxscale.mesh import make_mesh
    from jaxscale.validate import validate

    laid = with_overrides(config, layout.overrides())
    try:
        validate(laid, target.devices, target.hosts)
        if target.device_list:
            make_mesh(laid.mesh, list(target.device_list), laid.mesh_dcn)
    except (ConfigError, NotImplementedError, ValueError):
        return False
    return True


def with_overrides(config, overrides: dict):
    """A copy of `config` with the dotted keys set (through the checks `--config.KEY=VALUE` takes)."""
    from jaxscale.config import apply_overrides

    copy = ml_collections.ConfigDict(config.to_dict())
    apply_overrides(copy, [f"{key}={value!r}" for key, value in overrides.items()])
    return copy


def _compile_one(config, layout: layouts.Candidate, topology_name: str | None, count: int) -> Plan:
    """The plan of one layout (jaxscale.analysis.step_plan.describe), compiled for the named topology or this
    host's first `count` devices; runs in a worker process or in this one."""
    from jaxscale.analysis.step_plan import compile_plan, describe

    devices, platform = jax.devices()[:count], jax.default_backend()
    if topology_name:
        from jaxscale.analysis import topology

        devices, pod = topology.compile_only_devices(topology_name)
        platform = pod.platform
        jax.config.update("jax_enable_compilation_cache", False)
    laid = with_overrides(config, layout.overrides())
    return describe(laid, *compile_plan(laid, platform, devices))


def _workers(requested: int | None) -> int:
    return max(1, requested if requested else min(4, (os.cpu_count() or 1)))


class _InProcess:
    """An executor that runs each call as it is submitted, in this process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    @staticmethod
    def submit(fn, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as error:  # a compiler's refusal of one layout, reported with the others
            future.set_exception(error)
        return future


def compile_all(config, chosen: list[layouts.Candidate], target: Target, budget_s: float, workers: int | None = None):
    """([(layout, compiled plan)], [(layout, why it did not compile)]) of the chosen layouts,
    started while `budget_s` lasts (the first always), in `workers` processes (1: this one)."""
    count = _workers(workers)
    start, done, failed, pending, queue = time.perf_counter(), [], [], {}, list(chosen)
    pool = _InProcess() if count == 1 else concurrent.futures.ProcessPoolExecutor(
        count, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        while queue or pending:
            while queue and len(pending) < count and (
                    not (done or failed or pending) or time.perf_counter() - start <= budget_s):
                layout = queue.pop(0)
                pending[pool.submit(_compile_one, config, layout, target.name, target.devices)] = layout
            if not pending:
                break
            finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                layout = pending.pop(future)
                if future.exception() is None:
                    done.append((layout, future.result()))
                else:
                    failed.append((layout, str(future.exception()).splitlines()[0][:160]))
    return done, failed


def row_of(layout: layouts.Candidate, plan: Plan, config, target: Target) -> Row:
    """A compiled plan priced and summarised."""
    machine = target.machine
    prediction = cost.predict(plan.work, machine, {"data": layout.dcn_data})
    tokens = config.train.global_batch_size * config.train.seq_len
    per_token = plan.flops.formula_per_device * math.prod(plan.mesh.values()) / tokens
    tokens_per_s = tokens / prediction.step_s
    mfu = None if machine.shared_cores else tokens_per_s * per_token / (target.devices * machine.peak_flops)
    sent: dict[str, float] = {}
    for over in plan.collectives_by_axis.values():
        for axes, row in over.items():
            sent[axes] = sent.get(axes, 0.0) + row.sent_bytes / GIB
    total = plan.per_device_bytes.total
    return Row(layout, total, total <= machine.memory_bytes, prediction, tokens_per_s, mfu, sent, plan.compile_s)


@dataclasses.dataclass(frozen=True)
class Result:
    rows: list[Row]                              # ranked: those that fit first, fastest predicted first
    failed: list[tuple[layouts.Candidate, str]]     # layouts the compiler refused, and its first line
    estimated: int                               # candidates whose arithmetic fit the memory


def search(config, target: Target, count: int = 8, budget_s: float = 1200.0, workers: int | None = None,
           spread: bool = False) -> Result:
    """The compiled candidates, ranked, and those that did not compile; with `spread` also the best
    estimate of each combination of split axes."""
    ranked = ranked_estimates(config, target)
    chosen = _picked(ranked, config, target, count, spread)
    compiled, failed = compile_all(config, chosen, target, budget_s, workers)
    rows = [row_of(layout, plan, config, target) for layout, plan in compiled]
    return Result(sorted(rows, key=_rank), failed, len(ranked))


def _rank(row: Row) -> tuple:
    """Those that fit first, then by predicted step, then by the time of their collectives."""
    return not row.fits, row.prediction.step_s, row.prediction.hidden_s + row.prediction.exposed_s


def best_overrides(rows: list[Row]) -> dict[str, object]:
    """The first row's layout as dotted config keys and values; ConfigError when nothing fits."""
    if not rows or not rows[0].fits:
        raise ConfigError("--search", "no compiled layout fits", "plan for a larger topology or a smaller batch")
    return rows[0].layout.overrides()


def command_line(config_path: str, overrides: dict[str, object]) -> str:
    """The training command that runs a layout."""
    flags = " ".join(f"--config.{k}={v!r}" if isinstance(v, str) else f"--config.{k}={v}" for k, v in overrides.items())
    return f"python -m jaxscale.train --config={config_path} {flags}"


def table(rows: list[Row], target: Target, tokens: float | None = None) -> str:
    """The ranked table (memory and bytes sent in GiB, or MiB for a small model), the machine's
    assumptions under it."""
    unit, scale = ("GiB", GIB) if max((r.total_bytes for r in rows), default=0) >= GIB else ("MiB", 2**20)
    memory = target.machine.memory_bytes
    head = f"{'#':>2} {'layout':<44}{unit + '/dev':>9}{'free':>8}{'step ms':>10}{'tok/s':>11}{'MFU':>6}{'bubble':>7}"
    head += f"{'days':>8}{'chip-h':>10}" if tokens else ""
    lines = [head + f"  {unit} sent a step, by mesh axes"]
    for i, r in enumerate(rows, 1):
        free = f"{(memory - r.total_bytes) / scale:.1f}" if math.isfinite(memory) else "-"
        line = (f"{i:>2} {r.layout.describe():<44}{r.total_bytes / scale:>9.2f}{free:>8}"
                f"{r.prediction.step_s * 1e3:>10.1f}{r.tokens_per_s:>11,.0f}"
                f"{'-' if r.mfu is None else f'{r.mfu:.0%}':>6}{r.prediction.bubble:>7.0%}")
        if tokens:
            days = tokens / r.tokens_per_s / 86400
            line += f"{days:>8.1f}{days * 24 * target.devices:>10,.0f}"
        shown = sorted((kv for kv in r.sent_by_axis.items() if kv[1] * GIB >= scale / 200), key=lambda kv: -kv[1])
        top = shown[:3]
        line += "  " + (", ".join(f"{axes} {gib * GIB / scale:.2f}" for axes, gib in top) or "-")
        lines.append(line + ("  (does not fit)" if not r.fits else ""))
    return "\n".join(lines + [f"assumed: {a}" for a in target.machine.assumptions])


def records(rows: list[Row], target: Target, tokens: float | None = None) -> list[dict]:
    """The ranked rows as plain dicts (one a layout), for a DataFrame or JSON."""
    out = []
    for rank, r in enumerate(rows, 1):
        record = {"rank": rank, "layout": r.layout.describe(), "overrides": r.layout.overrides(),
                  "bytes_per_device": r.total_bytes, "fits": r.fits, "step_s": r.prediction.step_s,
                  "compute_s": r.prediction.compute_s, "memory_s": r.prediction.memory_s,
                  "exposed_collectives_s": r.prediction.exposed_s, "hidden_collectives_s": r.prediction.hidden_s,
                  "bubble": r.prediction.bubble, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
                  "sent_gib_by_axes": r.sent_by_axis, "compile_s": r.compile_s}
        if tokens:
            record["days"] = tokens / r.tokens_per_s / 86400
            record["chip_hours"] = record["days"] * 24 * target.devices
        out.append(record)
    return out


def draw(rows: list[Row], target: Target, path) -> None:
    """Predicted step time against memory per device, one point a layout (the best marked), as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for fits, marker in ((True, "o"), (False, "x")):
        chosen = [r for r in rows if r.fits == fits]
        axes.scatter([r.total_bytes / GIB for r in chosen], [r.prediction.step_s * 1e3 for r in chosen],
                     marker=marker, label="fits" if fits else "does not fit")
    if rows and rows[0].fits:
        best = rows[0]
        axes.annotate(best.layout.describe(), (best.total_bytes / GIB, best.prediction.step_s * 1e3), fontsize=8)
    if math.isfinite(target.machine.memory_bytes):
        axes.axvline(target.machine.memory_bytes / GIB, color="grey", linestyle="--", label="device memory")
    axes.set(xlabel="GiB per device (compiled)", ylabel="predicted step (ms)",
             title=f"layouts on {target.machine.name}")
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
