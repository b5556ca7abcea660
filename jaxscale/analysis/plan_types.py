"""The plan of one train step as typed records, and their JSON.

`Plan` is what `jaxscale.analysis.step_plan.describe` reads from a compiled step (memory rows,
collectives by kind and by mesh axes, FLOPs, the pipeline's table, the expected run, notes) and
what `python -m jaxscale.plan` adds for a target (topology, memory limit, fit, warnings).
`StepWork` is the part of a step the cost model prices (jaxscale.analysis.cost): a compiled
plan's (`Plan.work`) or a layout's arithmetic estimate (jaxscale.analysis.layouts.estimate).

`to_json()` gives the plan as `python -m jaxscale.plan --json` prints it: the fields in order,
the optional ones left out while unset, numbers as they were read (a count is an int where the
program runs it a whole number of times and a float where a conditional's share weighs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

_OMIT_UNSET = {"omit_unset": True}


def _unset():
    """A field left out of the JSON while it is None."""
    return dataclasses.field(default=None, metadata=_OMIT_UNSET)


def to_json(value):
    """A record (or a dict, list or tuple of them) as plain JSON-ready values, fields in order."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_unset") and getattr(value, f.name) is None)}
    if isinstance(value, Mapping):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    return value


class _Record:
    def to_json(self) -> dict:
        return to_json(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSummary(_Record):
    """The schedule's table, summarised: its bubble, and with a pipeline its ticks, microbatches in
    flight per stage and drawing (stages x ticks, F B W or . per tick)."""

    stages: int
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    ticks: int | None = _unset()
    bubble_fraction: float = 0.0
    in_flight: tuple[int, ...] | None = _unset()
    drawing: str | None = _unset()


@dataclasses.dataclass(frozen=True)
class MemoryRows(_Record):
    """Per-device bytes of a compiled step in rows that add up to its peak (`total`); `grads` is
    part of `temp`, not another row. Under LoRA `params` are the adapters and `frozen` the base;
    under DPO without LoRA `frozen` is the reference's copy."""

    params: int
    opt_state: int
    other_args: int
    temp: int
    outputs: int
    total: int
    grads: int
    frozen: int = 0


@dataclasses.dataclass(frozen=True)
class EstimatedBytes(_Record):
    """Per-device bytes of a layout by arithmetic: the state's rows the cost model reads, and the
    estimated peak (`total`: state + saved activations + logits)."""

    params: float
    opt_state: float
    temp: float
    total: float


@dataclasses.dataclass(frozen=True)
class CompiledBytes(_Record):
    """`compiled.memory_analysis()` as the compiler reports it."""

    argument: int
    output: int
    temp: int
    alias: int
    code: int


@dataclasses.dataclass(frozen=True)
class HostBytes(_Record):
    """Per-device bytes of the state kept in pinned host memory (offload)."""

    params: int
    opt_state: int


@dataclasses.dataclass(frozen=True)
class StateBytes(_Record):
    """The state's per-device bytes by arithmetic (jaxscale.analysis.state_bytes.expected_bytes)."""

    params: float
    grads: float
    opt_state: float


@dataclasses.dataclass(frozen=True)
class KindTotal(_Record):
    """One kind of collective in a step: how many run and the bytes of their results."""

    count: int
    bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class AxisCollective(_Record):
    """One kind of collective over one group of mesh axes: how many run, the bytes of their results
    (None for an estimate, which counts only what is sent) and the bytes each device sends."""

    count: float
    bytes: float | None = _unset()
    sent_bytes: float


ByAxis = dict[str, dict[str, AxisCollective]]  # {kind: {mesh axes ("data+fsdp"): row}}


def by_axis(table: Mapping[str, Mapping[str, Mapping[str, float]]]) -> ByAxis:
    """{kind: {axes: {"count", "bytes", "sent_bytes"}}} (hlo_stats.StepTotals.by_axis) as records."""
    return {kind: {axes: AxisCollective(**row) for axes, row in over.items()} for kind, over in table.items()}


@dataclasses.dataclass(frozen=True)
class Flops(_Record):
    """Matmul FLOPs per device per step: the compiled program's (None where the compiler writes
    convolutions, or for an estimate), the PaLM formula's share of one device, and their ratio."""

    compiled_per_device: float | None
    formula_per_device: float
    ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class ExpectedRun(_Record):
    """What one step is expected to run: each conditional's branches by their share."""

    dot_flops: float | None
    collectives_by_axis: ByAxis


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window(_Record):
    """Collectives over one group of mesh axes alike in kind, bytes sent a run and the matmul FLOPs
    the schedule runs beside each (0: it blocks), `runs` of them a step (jaxscale.analysis.overlap)."""

    axes: str
    kind: str
    sent_bytes: float
    flops_beside: float
    runs: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class AxisOverlap(_Record):
    """One group of mesh axes' collectives a step: bytes each device sends, the part sent by
    asynchronous collectives with matmuls scheduled beside them (`async_bytes`), those matmuls'
    FLOPs, and on a named target the bytes that compute can hide at its link and matmul rates
    and the exposed rest."""

    sent_bytes: float
    async_bytes: float
    flops_beside: float
    hidden_bytes: float | None = _unset()
    exposed_bytes: float | None = _unset()


@dataclasses.dataclass(frozen=True)
class TopologySummary(_Record):
    """The named target a plan was compiled for."""

    name: str
    slices: int
    chips_per_slice: int
    devices: int
    device_kind: str


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What the cost model prices of a step: its mesh and remat, pipeline, FLOPs, the bytes it
    moves through memory, and its collectives by mesh axes (with `expected`, those of the run
    expected, which are then priced instead)."""

    mesh: dict[str, int]
    remat: str
    pipeline: PipelineSummary
    flops: Flops
    per_device_bytes: MemoryRows | EstimatedBytes
    collectives_by_axis: ByAxis
    expected: ExpectedRun | None = None
    windows: tuple[Window, ...] | None = None  # a compiled step's, as scheduled (None: an estimate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(_Record):
    """The plan of a compiled train step; the last five fields are set by `python -m jaxscale.plan`
    for its target."""

    mesh: dict[str, int]
    zero_stage: int
    remat: str
    pipeline: PipelineSummary
    platform: str
    compute_dtype: str
    num_params: int
    compile_s: float
    per_device_bytes: MemoryRows
    argument_bytes: int
    compiled_bytes: CompiledBytes
    host_bytes: HostBytes
    expected_bytes: StateBytes
    collectives: dict[str, KindTotal]
    collectives_by_axis: ByAxis
    flops: Flops
    expected: ExpectedRun
    overlap: dict[str, AxisOverlap]          # by mesh axes (jaxscale.analysis.overlap.by_axis)
    windows: tuple[Window, ...]              # the expected run's collectives with the compute beside each
    notes: tuple[str, ...] = ()
    frozen: str = ""   # what per_device_bytes.frozen holds: "base" (LoRA), "reference" (DPO's copy) or ""
    topology: TopologySummary | None = _unset()
    memory_limit_bytes: float | None = _unset()
    fits: bool | None = _unset()
    warnings: tuple[str, ...] | None = _unset()
    predicted: object | None = _unset()  # the target's jaxscale.analysis.cost.Prediction

    @property
    def work(self) -> StepWork:
        """What the cost model prices of this plan."""
        return StepWork(self.mesh, self.remat, self.pipeline, self.flops, self.per_device_bytes,
                        self.collectives_by_axis, self.expected, self.windows)
