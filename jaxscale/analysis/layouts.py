"""The layouts a search considers, and the arithmetic that ranks them before anything compiles.

A layout is a set of config overrides: every mesh axis (`mesh.data` ... `mesh.expert`, and
`mesh_dcn.data` across slices or hosts), `zero_stage`, `model.remat`, and with a pipeline its
schedule and microbatches. `candidates` yields those the model and the devices allow (heads, KV
heads, layers, experts, sequence and batch divisible as each axis needs; tensor and sequence
inside one fast domain); `estimate` gives each one's per-device memory, FLOPs and collectives by
arithmetic as the StepWork that jaxscale.analysis.cost prices, as it prices a compiled plan's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jaxscale.analysis.plan_types import AxisCollective, EstimatedBytes, Flops, PipelineSummary, StepWork
from jaxscale.analysis.state_bytes import expected_bytes
from jaxscale.models.families import head_size
from jaxscale.names import AXES
from jaxscale.parallel import schedules

REMATS = ("none", "dots_saveable", "full")
SEARCHED_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))  # (schedule, virtual stages) a search tries


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate: mesh sizes (whole mesh; `dcn_data` of `data` cross slow links), ZeRO stage,
    remat, the pipeline's schedule, microbatches and virtual stages, and the context-parallel
    attention."""

    mesh: tuple[tuple[str, int], ...]
    dcn_data: int
    zero_stage: int
    remat: str
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    context: str = "ring"  # with the sequence split: ring, all_gather or ulysses

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def overrides(self) -> dict[str, object]:
        """The dotted config keys and values of this layout, as `--config.KEY=VALUE` takes them."""
        sizes = self.sizes
        out: dict[str, object] = {f"mesh.{a}": sizes[a] // (self.dcn_data if a == "data" else 1) for a in AXES}
        out.update({"mesh_dcn.data": self.dcn_data, "zero_stage": self.zero_stage, "model.remat": self.remat})
        if sizes["pipeline"] > 1:
            out.update({"pipeline.schedule": self.schedule, "pipeline.microbatches": self.microbatches,
                        "pipeline.virtual_stages": self.virtual})
        if sizes["sequence"] > 1:
            out["model.attention.context_parallel"] = self.context
        return out

    def describe(self) -> str:
        """'fsdp=16 tensor=8 zero1 full 1f1b x8', the axes above 1 first."""
        parts = [f"{a}={n}" for a, n in self.mesh if n > 1] or ["1 device"]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        parts.append(self.remat)
        if self.sizes["pipeline"] > 1:
            parts.append(f"{self.schedule} x{self.microbatches}" + (f" v{self.virtual}" if self.virtual > 1 else ""))
        if self.sizes["sequence"] > 1:
            parts.append(self.context)
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, parts: int):
    """Every ordered tuple of `parts` positive integers whose product is n."""
    if parts == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorizations(n // d, parts - 1):
            yield (d, *rest)


def candidates(config, devices: int, slices: int, fast_domain: int, remats=REMATS):
    """Layouts of `devices` (in `slices` slices or hosts joined by slow links) the model allows."""
    m, t = config.model, config.train
    head_dim_ok = m.d_model % m.num_heads == 0
    experts = m.moe.num_experts
    for data, pipeline, fsdp, expert, sequence, tensor in _factorizations(devices, len(AXES)):
        sizes = dict(zip(AXES, (data, pipeline, fsdp, expert, sequence, tensor)))
        if data % slices or not head_dim_ok:
            continue
        if m.num_heads % tensor or m.d_ff % tensor or tensor * sequence > fast_domain:
            continue
        if t.seq_len % (sequence * (2 if sequence > 1 else 1)) or m.num_layers % pipeline:
            continue
        if expert > 1 and (not experts or experts % expert):
            continue
        batch = data * fsdp * expert
        if t.global_batch_size % (batch * t.grad_accum_steps):
            continue
        local = t.global_batch_size // (batch * t.grad_accum_steps)
        mesh = tuple(sizes.items())
        # ZeRO-3 over data inside one slice splits what fsdp splits, the same program: left to fsdp.
        stages = (range(4) if slices > 1 else range(3)) if data > 1 else (0,)
        for zero, remat, context in itertools.product(stages, remats, _contexts(m, sequence, tensor)):
            if pipeline == 1:
                yield Candidate(mesh, slices, zero, remat, context=context)
                continue
            # beside context parallelism the stages run by autodiff through GPipe's forward
            schedules_here = SEARCHED_SCHEDULES if sequence == 1 else (("gpipe", 1),)
            for (schedule, virtual), factor in itertools.product(schedules_here, (1, 2, 4)):
                micro = pipeline * factor
                if local % micro == 0 and m.num_layers % (pipeline * virtual) == 0:
                    yield Candidate(mesh, slices, zero, remat, schedule, micro, virtual, context)


def _contexts(m, sequence: int, tensor: int) -> tuple[str, ...]:
    """The context-parallel attentions a model takes with the sequence split `sequence` ways
    (ring and all_gather have no windows or capped scores; ulysses splits each device's heads)."""
    if sequence == 1:
        return ("ring",)
    plain = () if "L" in m.layer_pattern or m.attn_logit_softcap else ("ring", "all_gather")
    return plain + (("ulysses",) if (m.num_heads // tensor) % sequence == 0 else ())


def bubble(layout: Candidate) -> float:
    """The schedule table's idle share of stage-ticks (0 without a pipeline)."""
    p = layout.sizes["pipeline"]
    if p == 1:
        return 0.0
    return schedules.build(layout.schedule, p, layout.microbatches, layout.virtual).bubble()


def estimate(config, layout: Candidate, counts: dict[str, int], flops_per_token: float) -> StepWork:
    """What a step of `layout` runs, by arithmetic (the parts of a compiled plan the cost model
    reads), with `per_device_bytes.total` the per-device peak: state + saved activations + logits."""
    m, t, s = config.model, config.train, layout.sizes
    width = 4 if m.dtype == "float32" else 2
    tokens = t.global_batch_size * t.seq_len
    batch = s["data"] * s["fsdp"] * s["expert"]
    micro = tokens / batch / s["sequence"] / t.grad_accum_steps / layout.microbatches  # a device's tokens at once
    layers = m.num_layers / s["pipeline"]
    state = expected_bytes(counts, s, layout.zero_stage)
    activations = micro * layers * _saved_per_token(m, layout.remat, s["tensor"]) * width
    in_flight = s["pipeline"] if s["pipeline"] > 1 else 1
    logits = min(m.head_chunk_mib * 2**20 or math.inf, micro * m.vocab_size / s["tensor"] * 4)
    total = state["params"] + state["grads"] + state["opt_state"] + activations * in_flight + 2 * logits
    per_stage = width / (s["tensor"] * s["pipeline"])  # the bytes of a parameter on a stage's tensor shard
    model_bytes = (per_stage * (counts["layers"] - counts["experts"] + counts["other"]),  # gathered over fsdp x expert
                   per_stage * counts["experts"] / s["expert"])  # a device's experts: gathered over fsdp
    held = _held_gradient(config, layout, counts)
    total += held
    temp = activations * in_flight + state["grads"] + held
    return StepWork(s, layout.remat, PipelineSummary(stages=s["pipeline"], bubble_fraction=bubble(layout)),
                    Flops(None, flops_per_token * tokens / math.prod(s.values())),
                    EstimatedBytes(state["params"], state["opt_state"], temp, total),
                    {"estimate": _collectives(config, layout, tokens / batch / s["sequence"], model_bytes, width)})


def _held_gradient(config, layout: Candidate, counts: dict[str, int]) -> float:
    """The bytes of the part of one layer's gradient that sharding.overlap=all holds whole while
    it is reduce-scattered beside the next layer's backward pass (Transformer._deferred,
    models.transformer.DEFERRED), or 0."""
    m, s = config.model, layout.sizes
    splitting = {"fsdp"} | ({"data"} if layout.zero_stage == 3 else set())
    batch = [a for a in ("data", "fsdp", "expert") if s[a] > 1]
    if (layout.remat != "full" or config.sharding.overlap != "all" or m.moe.num_experts or m.lora.rank or m.fp8
            or s["sequence"] > 1 or s["pipeline"] > 1 or not batch or not set(batch) <= splitting):
        return 0.0
    width = 4 if "float32" in (m.dtype, config.optim.grad_reduce_dtype) else 2
    return width * counts["deferred"] / m.num_layers / s["tensor"]


def _context_row(m, mode: str, n: int, layers: float, chunks: int, heads_act: float, recompute: bool
                 ) -> AxisCollective:
    """What a device sends over `sequence` (n ways) a step for `layers` attention layers, each run
    on `chunks` microbatches, `heads_act` the bytes of its share of a layer's queries a step (its
    rows, its length, its heads): ring passes K and V round n - 1 hops forward and twice backward
    (the second with their gradients' sums); all_gather gathers them forward (again under full
    remat) and reduce-scatters their gradients; ulysses all-to-alls the queries, keys, values and
    output forward (again under full remat) and their gradients backward (keys and values at one
    per query head when too few to split)."""
    passes = 3 if recompute else 2
    if mode == "ulysses":
        kv_heads = m.num_kv_heads if m.num_kv_heads % n == 0 else m.num_heads
        kv = heads_act * 2 * kv_heads / m.num_heads
        return AxisCollective(count=4 * passes * layers * chunks,
                              sent_bytes=passes * layers * (2 * heads_act + kv) * (n - 1) / n)
    kv = heads_act * 2 * m.num_kv_heads / m.num_heads  # keys and values
    if mode == "all_gather":
        return AxisCollective(count=2 * passes * layers * chunks, sent_bytes=passes * layers * kv * (n - 1))
    return AxisCollective(count=3 * layers * (n - 1) * chunks, sent_bytes=3 * layers * kv * (n - 1))


def _saved_per_token(m, remat: str, tensor: int) -> float:
    """Elements a layer keeps per token for its backward pass: everything it computed (none), its
    matmuls' outputs (dots_saveable) or only its input (full, which then recomputes one layer's)."""
    kv = 2 * m.num_kv_heads * head_size(m)
    if remat == "full":
        return m.d_model
    if remat == "dots_saveable":
        return (2 * m.d_model + kv + 2 * m.d_ff) / tensor + 2 * m.d_model
    return (4 * m.d_model + kv + 4 * m.d_ff) / tensor + 4 * m.d_model


def _collectives(config, layout: Candidate, tokens: float, model_bytes: tuple[float, float],
                 width: int) -> dict[str, AxisCollective]:
    """{mesh axis: its collectives' count and sent bytes} a device runs a step (`tokens`: its tokens a step;
    `width`: the bytes of an element; `model_bytes`: a stage's dense weights and a device's
    experts), by ring arithmetic: weights gathered twice and gradients reduce-scattered over fsdp
    (the dense weights over fsdp x expert: the part past fsdp's ring on the expert row; and over
    data at ZeRO-3; gradients all-reduced over data below it), two all-reduces of the activations
    a layer forward and two backward over tensor (three each with full remat), the attention's
    traffic over sequence (`_context_row`), tokens to experts and back over expert, and each
    microbatch's activations and gradients between pipeline stages."""
    m, s = config.model, layout.sizes
    layers = m.num_layers / s["pipeline"]
    act = tokens * m.d_model * width  # a device's activations of one layer, its whole batch of a step
    chunks = layout.microbatches * config.train.grad_accum_steps  # in-layer collectives run per chunk
    rows = {}

    def ring(n: int) -> float:
        return (n - 1) / n

    dense, experts = model_bytes
    if s["fsdp"] > 1:
        rows["fsdp"] = AxisCollective(count=3 * layers, sent_bytes=3 * (dense + experts) * ring(s["fsdp"]))
    gathers = AxisCollective(count=3 * layers, sent_bytes=3 * dense * (ring(s["fsdp"] * s["expert"]) - ring(s["fsdp"])))
    if s["data"] > 1:
        shard = dense / (s["fsdp"] * s["expert"]) + experts / s["fsdp"]
        passes = 3 if layout.zero_stage == 3 else 2
        rows["data"] = AxisCollective(count=passes * layers, sent_bytes=passes * shard * ring(s["data"]))
    if s["tensor"] > 1:
        passes = 6 if layout.remat == "full" else 4
        rows["tensor"] = AxisCollective(count=passes * layers * chunks,
                                        sent_bytes=passes * layers * 2 * act * ring(s["tensor"]))
    if s["sequence"] > 1:
        rows["sequence"] = _context_row(m, layout.context, s["sequence"], layers, chunks, act / s["tensor"],
                                        layout.remat == "full")
    if s["expert"] > 1:
        moe_layers = (m.num_layers - m.moe.first_dense) / max(1, m.moe.every_n_layers) / s["pipeline"]
        rows["expert"] = AxisCollective(count=4 * moe_layers * chunks + gathers.count, sent_bytes=gathers.sent_bytes
                                        + 4 * moe_layers * act * m.moe.top_k * ring(s["expert"]))
    if s["pipeline"] > 1:
        rows["pipeline"] = AxisCollective(count=2 * layout.microbatches * layout.virtual,
                                          sent_bytes=2 * act * layout.virtual)
    return rows
