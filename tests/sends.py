"""The collectives spec's vocabulary: the sizes its formulas are written in, and the check that a
compiled plan sends what a spec says (tests/test_plan.py on XLA:CPU, tests/test_topology.py on
the TPU compiler)."""

from __future__ import annotations

import dataclasses
import math

import pytest

BIG = 0.02  # of W: a row carrying less (norm scales, scalars, token ids) may be left out of a spec


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Bytes in float32 for one layout of one config; 'one device's' means its share of the
    batch rows (data x fsdp x expert) and of the length (sequence), whole over `tensor`."""

    w: float          # every parameter (W)
    t: float          # the tied embedding's second gradient term: vocab x d_model (T)
    a: float          # one device's activations, [rows, length, d_model] (A)
    kv: float         # one device's keys (or values), [rows, length, kv_heads, head_dim] (K)
    layer: float      # one dense layer's parameters
    experts: float    # every expert's weights (all MoE layers)
    dispatch: float   # one device's tokens sent to the experts, [rows, experts, capacity, d_model] (X)
    layers: int
    moe_layers: int

    @classmethod
    def of(cls, config, plan: dict) -> Sizes:
        m, mesh, t = config.model, plan["mesh"], config.train
        rows = t.global_batch_size // (mesh["data"] * mesh["fsdp"] * mesh["expert"])
        length, head_dim = t.seq_len // mesh["sequence"], m.d_model // m.num_heads
        attention = 2 * m.d_model * (m.num_heads + m.num_kv_heads) * head_dim
        moe = m.moe.num_experts and m.num_layers // m.moe.every_n_layers
        experts = m.moe.num_experts
        capacity = experts and min(length, math.ceil(m.moe.capacity_factor * length * m.moe.top_k / experts))
        return cls(w=4 * plan["num_params"], t=4 * m.vocab_size * m.d_model, a=4 * rows * length * m.d_model,
                   kv=4 * rows * length * m.num_kv_heads * head_dim,
                   layer=4 * (attention + 3 * m.d_model * m.d_ff + 2 * m.d_model),
                   experts=4 * moe * experts * 3 * m.d_model * (m.moe.d_ff or m.d_ff),
                   dispatch=4 * rows * experts * capacity * m.d_model, layers=m.num_layers, moe_layers=moe)


def sent_by_axis(plan: dict) -> dict[tuple[str, str], float]:
    """A plan's collectives as {(kind, mesh axes): bytes each device sends per step}."""
    return {(kind, axes): row["sent_bytes"] for kind, over in plan["collectives_by_axis"].items()
            for axes, row in over.items()}


def assert_sends(plan: dict, spec: dict, sizes: Sizes, rel: float = 0.10) -> None:
    """The plan's collectives are the spec's rows, over the axes they name and no others: each
    within `rel` of its formula. Rows under BIG x W may be left out of the spec, but they too
    run over no mesh axis the spec does not name."""
    sent = sent_by_axis(plan)
    big = {key for key, value in sent.items() if value >= BIG * sizes.w}
    assert big <= set(spec), f"sends {sorted(big - set(spec))} the spec does not list"
    named = {axis for _, axes in spec for axis in axes.split("+")}
    assert all(set(axes.split("+")) <= named for _, axes in sent), f"runs over axes the spec does not name: {sent}"
    for key, formula in spec.items():
        assert sent.get(key, 0.0) == pytest.approx(formula(sizes), rel=rel), key
