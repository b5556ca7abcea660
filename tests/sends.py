"""The collectives spec's vocabulary: the sizes its formulas are written in, and the check that a
compiled plan sends what a spec says (tests/test_plan.py on XLA:CPU, tests/test_topology.py on
the TPU compiler)."""

from __future__ import annotations

import dataclasses
import math
import re

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
        length, head_dim = t.seq_len // mesh["sequence"], m.head_dim or m.d_model // m.num_heads
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


def param_groups(config) -> dict[str, int]:
    """A dense model's parameter count from its config alone, by how the rules split them:
    `layers` (pipeline, fsdp, expert, tensor), `layer_vectors` (norm scales and biases along d_model:
    pipeline only), `other` (embedding, head, learned positions: fsdp, expert, tensor), `vectors` (the
    final norm: whole)."""
    m = config.model
    D, H, K, F, V, L = m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size, m.num_layers
    E, gpt2 = m.head_dim or D // H, m.family == "gpt2"
    attention = 2 * D * H * E + 2 * D * K * E + (H * E + 2 * K * E if gpt2 else 0)
    mlp = 2 * D * F + F if gpt2 else 3 * D * F
    other = V * D * (1 if m.tie_embeddings else 2) + (m.max_seq_len * D if gpt2 else 0)
    vectors = 2 * D if gpt2 else D  # LayerNorm's scale and bias, or RMSNorm's scale
    return {"layers": L * (attention + mlp), "layer_vectors": L * (2 * vectors + (2 * D if gpt2 else 0)),
            "other": other, "vectors": vectors}


def state_bytes(config, devices: int) -> dict[str, float]:
    """Per-device bytes of float32 parameters (4N), gradients (4N) and Adam state (8N) by the
    arithmetic, from the config's mesh and ZeRO stage (never from a planner's layout): each
    divided by the devices that split it, ZeRO adding `data` from stage 1 (optimizer state), 2
    (gradients) and 3 (parameters)."""
    from jaxscale.mesh import resolve_shape

    shape, zero, n = resolve_shape(config.mesh, devices), config.zero_stage, param_groups(config)
    model_parallel = shape["fsdp"] * shape["expert"] * shape["tensor"]
    spread = (n["layers"] / (shape["pipeline"] * model_parallel) + n["layer_vectors"] / shape["pipeline"]
              + n["other"] / model_parallel + n["vectors"])

    def per_device(bytes_per_param: int, stage: int) -> float:
        return bytes_per_param * spread / (shape["data"] if zero >= stage else 1)

    return {"params": per_device(4, 3), "grads": per_device(4, 2), "opt_state": per_device(8, 1)}


def vocabulary_arrays(hlo_text: str, vocab: int) -> set[int]:
    """For every array in a compiled program with a dimension of the whole vocabulary, the number
    of elements beside it (d_model / its split for a device's slice of the table; the whole
    d_model for a whole table, the tokens for their logits). Pick a vocabulary size nothing else
    in the model has."""
    shapes = re.findall(rf"\w+\[((?:\d+,)*{vocab}(?:,\d+)*)\]", hlo_text)
    return {math.prod(int(d) for d in dims.split(",")) // vocab for dims in shapes}
