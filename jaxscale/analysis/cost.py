"""A step-time model of a compiled train step, and the machines it describes.

    predicted = compute / (1 - bubble)  +  memory  +  exposed collectives
                (with the collectives the compiler can hide under compute taking the larger of the two)

- compute: the step's matmul FLOPs per device (read from the compiled program where the compiler
  writes dots, each conditional's branches by their share; the PaLM formula, x 4/3 under full
  remat or in a pipeline, where it writes convolutions, as the TPU compiler does) at the
  machine's peak times a stated efficiency;
- bubble: the pipeline schedule's idle share of stage-ticks, from the table the step runs;
- memory: what is bound by memory bandwidth rather than matmuls: the optimizer's update, three
  passes over the state's bytes (read parameters and moments, write them back), and the step's
  temporaries (saved activations, gradients) written once and read once;
- collectives: each one's bytes per device (ring arithmetic, from the compiled HLO) over the
  slowest link its mesh axes cross, plus a latency. A compiled step's are priced as its schedule
  runs them (jaxscale.analysis.overlap): each hides behind the matmuls scheduled between its
  start and its done, and only the rest is exposed; a conditional's count by its branches' share
  (a pipeline executor runs one of its idle, forward, backward and weight-gradient branches a
  tick). An estimate (no program yet) takes those over data, fsdp and pipeline (weight gathers,
  gradient reductions, stage sends) as hidden and those over tensor, sequence and expert as
  exposed. Where several virtual devices share one host's cores (CPU), nothing overlaps and the
  devices' work adds up: the work each runs (a pipeline's idle ticks free the cores, so no
  bubble), and a collective's latency is what its rendezvous of the devices' threads costs
  inside a program.
"""

from __future__ import annotations

import dataclasses
import math

from jaxscale.analysis import overlap
from jaxscale.analysis.plan_types import StepWork

OVERLAPPED = frozenset({"data", "fsdp", "pipeline"})
FULL_REMAT_FACTOR = 4 / 3  # the forward pass again in the backward: 8N against 6N FLOPs a token


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the model needs of the hardware; every field per device, bandwidths one direction."""

    name: str
    peak_flops: float        # dense bf16 FLOP/s
    efficiency: float        # share of the peak the step's matmuls reach
    memory_bytes: float      # HBM a device may use
    memory_bandwidth: float  # bytes/s
    fast: float              # bytes/s inside a fast domain (ICI, NVLink)
    slow: float              # bytes/s across domains (DCN, InfiniBand)
    fast_domain: int         # devices a fast domain joins (a TPU slice, a GPU host)
    latency_s: float         # a collective's fixed cost
    shared_cores: bool = False  # virtual devices on one host's cores (CPU): work adds up, nothing overlaps
    assumptions: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    memory_s: float
    bubble: float
    hidden_s: float                  # collectives the scheduler can overlap with compute
    exposed_s: float                 # collectives on the critical path
    by_axis_s: dict[str, float]      # each mesh axis group's collective time


def link_speed(machine: Machine, axes: str, mesh: dict[str, int], dcn: dict[str, int]) -> float:
    """Bytes/s of the slowest link a collective over `axes` ("data+fsdp") crosses: slow where an
    axis spans slices (a DCN multiplier above 1) or, within a slice, devices of different fast
    domains (mesh axes fill the fast domain from the innermost out)."""
    names = axes.split("+")
    if any(dcn.get(a, 1) > 1 for a in names):
        return machine.slow
    order = list(mesh)  # outer to inner, as jaxscale.mesh builds it
    inner = 1
    for axis in reversed(order):
        inner *= mesh[axis] // dcn.get(axis, 1)
        if axis in names and inner > machine.fast_domain:
            return machine.slow
    return machine.fast


def matmul_flops(work: StepWork, shared_cores: bool = False) -> float:
    """Matmul FLOPs per device per step: the compiled program's expected run (a conditional's
    branches by their share) where the compiler writes dots; the formula's (x 4/3 with full remat
    and in a pipeline, whose stages are rematerialised whole) where it writes convolutions (the
    TPU compiler), for an estimate, and in a pipeline on devices that run in parallel, whose step
    is a stage's work over the ticks that are not bubble."""
    flops, stages = work.flops, work.pipeline.stages
    compiled = flops.compiled_per_device if work.expected is None else work.expected.dot_flops
    if compiled is not None and (shared_cores or stages == 1):
        return compiled
    recomputed = work.remat == "full" or stages > 1  # a stage is rematerialised whole
    return flops.formula_per_device * (FULL_REMAT_FACTOR if recomputed else 1.0)


def predict(work: StepWork, machine: Machine, dcn: dict[str, int] | None = None) -> Prediction:
    """The predicted step time on `machine` of a step (a compiled plan's `Plan.work`, or a
    layout's estimate); with `work.expected`, its expected run's collectives are priced."""
    mesh, dcn = work.mesh, dcn or {}
    devices = math.prod(mesh.values()) if machine.shared_cores else 1  # whose work adds up
    bubble = work.pipeline.bubble_fraction
    idle = 1.0 if machine.shared_cores else 1 - bubble  # shared cores: an idle stage's tick frees them
    compute = devices * matmul_flops(work, machine.shared_cores) / (machine.peak_flops * machine.efficiency) / idle
    rows = work.per_device_bytes
    memory = devices * (3 * (rows.params + rows.opt_state) + 2 * rows.temp) / machine.memory_bandwidth
    if work.windows is not None:
        by_axis, hidden, exposed = _scheduled(work, machine, dcn)
    else:
        by_axis, hidden, exposed = _by_rule(work, machine, dcn)
    if machine.shared_cores:
        step = compute + memory + hidden + exposed
    else:
        step = max(compute, hidden) + memory + exposed
    return Prediction(step, compute, memory, bubble, hidden, exposed, by_axis)


def _scheduled(work: StepWork, machine: Machine, dcn: dict[str, int]) -> tuple[dict[str, float], float, float]:
    """(seconds by mesh axes, hidden, exposed) of a compiled step's collectives as its schedule
    runs them: each hides behind the matmuls scheduled beside it (jaxscale.analysis.overlap)."""
    by_axis: dict[str, float] = {}
    hidden = exposed = 0.0
    for w in work.windows:
        hides, takes = overlap.hidden_seconds(w, machine, link_speed(machine, w.axes, work.mesh, dcn))
        by_axis[w.axes] = by_axis.get(w.axes, 0.0) + takes * w.runs
        hidden += hides * w.runs
        exposed += (takes - hides) * w.runs
    return by_axis, hidden, exposed


def _by_rule(work: StepWork, machine: Machine, dcn: dict[str, int]) -> tuple[dict[str, float], float, float]:
    """(seconds by mesh axes, hidden, exposed) of an estimate's collectives: those over data, fsdp
    and pipeline hidden, the rest exposed."""
    collectives = work.collectives_by_axis if work.expected is None else work.expected.collectives_by_axis
    by_axis: dict[str, float] = {}
    for over in collectives.values():
        for axes, row in over.items():
            if axes in ("", "none"):
                continue
            seconds = row.sent_bytes / link_speed(machine, axes, work.mesh, dcn) + row.count * machine.latency_s
            by_axis[axes] = by_axis.get(axes, 0.0) + seconds
    hidden = sum(t for axes, t in by_axis.items() if set(axes.split("+")) <= OVERLAPPED)
    return by_axis, hidden, sum(by_axis.values()) - hidden
