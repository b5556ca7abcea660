"""The model's parallel strategy: which pipeline schedule, context-parallel attention and expert
dispatch its forward runs, and over which layout. Part of ModelSpec, so it shows wherever the
model does; the model never looks at an ambient layout to choose an algorithm.

The default, `Strategy()`, is one program with no manual collectives: the same math on any
device count (GSPMD still splits it as the sharding constraints say). `Strategy.for_layout`
turns on the algorithm of each mesh axis that needs one.
"""

from __future__ import annotations

import dataclasses

from jaxscale.names import CONTEXT_PARALLEL, OVERLAPS, PIPELINE_SCHEDULES
from jaxscale.parallel import schedules
from jaxscale.parallel.collective_matmul import fits as fits_collective_matmuls
from jaxscale.sharding import Layout

PIPELINES = ("none", *PIPELINE_SCHEDULES)  # Strategy.pipeline's choices
CONTEXT_ALGORITHMS = ("none", *CONTEXT_PARALLEL)
EXPERT_DISPATCH = ("local", "all_to_all")


def overlap_for(setting: str, compiler: str) -> str:
    """sharding.overlap's answer for a step compiled for platform `compiler`: auto is head for the
    TPU compiler, whose weight gathers run asynchronously (SparseCore offload, runtime.xla_flags),
    so a chunk of the head gathered a chunk ahead runs beside the previous chunk's matmuls
    (Llama-3-8B on v5p-256 at fsdp=128: 8.7% of the bytes sent exposed against 11.4%, for 0.04
    GiB a chip; benchmarks/results/pods.md); off elsewhere, where that is unmeasured."""
    return ("head" if compiler == "tpu" else "off") if setting == "auto" else setting


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the forward pass is split across devices beyond what sharding rules express."""

    layout: Layout | None = None   # the mesh and rules the parallel code paths split over
    pipeline: str = "none"         # none | a schedule (names.PIPELINE_SCHEDULES): stages over mesh axis `pipeline`
    microbatches: int = 1          # pipeline microbatches a step
    virtual_stages: int = 1        # layer chunks per device (circular, interleaved_1f1b)
    schedule_file: str = ""        # with pipeline="file": each stage's actions (parallel.schedules.load)
    context: str = "none"          # none | ring | all_gather | ulysses: attention over mesh axis `sequence`
    experts: str = "local"         # local | all_to_all: MoE tokens exchanged over mesh axis `expert`
    overlap: str = "off"           # off | head | all (names.OVERLAPS): collectives a step away from the
                                   # compute that needs them (models.vocab, parallel.fsdp.scan_deferred)
    collective_matmul: bool = False  # dense layers' projections as collective matmuls over `tensor`
                                     # (parallel.collective_matmul), where sequence parallelism splits length

    def __post_init__(self):
        for name, value, choices, axis in (("pipeline", self.pipeline, PIPELINES, "pipeline"),
                                           ("context", self.context, CONTEXT_ALGORITHMS, "sequence"),
                                           ("experts", self.experts, EXPERT_DISPATCH, "expert")):
            if value not in choices:
                raise ValueError(f"Strategy.{name}={value!r}: choose one of {', '.join(choices)}")
            if value != choices[0] and (self.layout is None or self.layout.mesh.shape[axis] == 1):
                raise ValueError(f"Strategy.{name}={value!r} needs a layout whose mesh splits '{axis}'")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"Strategy.overlap={self.overlap!r}: choose one of {', '.join(OVERLAPS)}")

    @classmethod
    def for_layout(cls, layout: Layout, *, schedule: str = "gpipe", microbatches: int = 1,
                   virtual_stages: int = 1, context: str = "ring", schedule_file: str = "",
                   overlap: str = "off", collective_matmul: bool = False) -> Strategy:
        """The strategy a run on `layout` uses: each algorithm on where its mesh axis is split."""
        shape = layout.mesh.shape
        return cls(layout, pipeline=schedule if shape["pipeline"] > 1 else "none",
                   microbatches=microbatches if shape["pipeline"] > 1 else 1,
                   virtual_stages=virtual_stages if shape["pipeline"] > 1 else 1,
                   schedule_file=schedule_file if shape["pipeline"] > 1 else "",
                   context=context if shape["sequence"] > 1 else "none",
                   experts="all_to_all" if shape["expert"] > 1 else "local", overlap=overlap,
                   collective_matmul=collective_matmul and fits_collective_matmuls(layout))

    @property
    def mesh(self):
        return None if self.layout is None else self.layout.mesh

    def table(self) -> schedules.Table:
        """The pipeline schedule's checked table (actions per tick and stage)."""
        stages = self.mesh.shape["pipeline"]
        if self.pipeline == "file":
            return schedules.load(self.schedule_file, stages, self.microbatches, self.virtual_stages)
        return schedules.build(self.pipeline, stages, self.microbatches, self.virtual_stages)

    def describe(self) -> str:
        """One line for the run summary, e.g. 'pipeline gpipe x4 microbatches, context ring'."""
        parts = []
        if self.pipeline != "none":
            parts.append(f"pipeline {self.pipeline} x{self.microbatches} microbatches"
                         + (f" x{self.virtual_stages} virtual stages" if self.virtual_stages > 1 else ""))
        if self.context != "none":
            parts.append(f"context {self.context}")
        if self.experts != "local":
            parts.append(f"experts {self.experts}")
        if self.collective_matmul:
            parts.append("collective matmuls over tensor")
        return ", ".join(parts) or "none"
