"""Which Hugging Face tensor holds which jaxscale parameter, and how its layout differs.

The mapping is data: one table per family. Every row names an HF tensor, the jaxscale
parameter(s) it holds and its storage kind; `to_ours` / `to_hf` are the only layout code.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Storage kinds of an HF tensor, seen from our parameter's per-layer shape:
LINEAR = "linear"  # torch nn.Linear weight [out, in]: ours is its transpose, reshaped
MATRIX = "matrix"  # stored [in, out] (GPT-2 Conv1D) or [rows, D] (embedding tables): ours reshaped
VECTOR = "vector"  # a bias or norm scale stored flat: ours reshaped

# HF's causal-LM classes keep the base model under this attribute; a checkpoint saved from the
# base model (GPT2Model, as on the original GPT-2 uploads) has the same names without it.
BASE_PREFIX = {"llama": "model.", "gpt2": "transformer.", "mistral": "model.", "qwen2": "model.", "qwen3": "model.",
               "gemma2": "model.", "gemma3": "model.", "mixtral": "model.", "qwen3_moe": "model.",
               "deepseek_v3": "model."}


# Our parameters stacked along a leading axis, one slice an HF layer: the layers' and the
# multi-token prediction modules' (PREDICTION).
PREDICTION = "mtp/"
STACKS = ("layers/", PREDICTION)


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF tensor. `ours` lists the parameter paths it holds ("layers/attn/wq"); several
    when HF fuses them (GPT-2's c_attn), concatenated along HF's output axis in that order.
    `in_dims` is how many leading dimensions of our per-layer shape form HF's input axis."""

    ours: tuple[str, ...]
    hf: str  # "{i}" stands for the layer index in names of stacked parameters, "{e}" for the expert
    kind: str
    in_dims: int = 1
    experts: bool = False  # one HF tensor per expert ("{e}"): ours stacks them on its first per-layer axis

    @property
    def stacked(self) -> bool:
        """One HF tensor per slice of a stack: the layers' (layers/...) or the prediction modules' (mtp/...)."""
        return self.ours[0].startswith(STACKS)

    @property
    def out_axis(self) -> int:
        """The HF axis along which fused parts are concatenated."""
        return 0 if self.kind == LINEAR else -1


def _rows(*rows) -> tuple[Row, ...]:
    return tuple(Row((ours,) if isinstance(ours, str) else ours, hf, kind, *rest) for ours, hf, kind, *rest in rows)


def _in_stack(row: Row, stack: str) -> Row:
    """The row for a mixture-of-experts model's stack `stack` ("first", "dense", "moe"): layers/x -> layers/STACK/x."""
    return dataclasses.replace(row, ours=tuple(path.replace("layers/", f"layers/{stack}/", 1) for path in row.ours))


def _moe_table(dense: tuple[Row, ...], router: str, experts: str, names: dict[str, str]) -> tuple[Row, ...]:
    """A mixture-of-experts family's rows: its dense relative's rows for the dense layers
    (layers/first/... and layers/dense/...) and the MoE layers' attention and norms
    (layers/moe/...), then the MoE layers' router (HF `router`) and experts (HF
    `experts`.{e}.NAME for each of ours in `names`)."""
    rows = [row for row in dense if not row.stacked]
    for row in (row for row in dense if row.stacked):
        rows += [_in_stack(row, "first"), _in_stack(row, "dense")]
        if not row.ours[0].startswith("layers/mlp/"):
            rows.append(_in_stack(row, "moe"))
    rows += _rows(("layers/moe/mlp/router", router, LINEAR),
                  *((f"layers/moe/mlp/{ours}", f"{experts}.{{e}}.{theirs}.weight", LINEAR, 1, True)
                    for ours, theirs in names.items()))
    return tuple(rows)


def _prediction_rows(table: tuple[Row, ...]) -> tuple[Row, ...]:
    """DeepSeek-V3's multi-token prediction modules (models.prediction), stored as the layers after
    the model's (model.layers.{num_hidden_layers + k - 1}): an MoE layer's tensors (mtp/block/...)
    beside the module's input norms, projection and final norm. Each also stores copies of the
    model's embedding and head (`PREDICTION_COPIES`), which the modules share."""
    block = tuple(dataclasses.replace(row, ours=tuple(p.replace("layers/moe/", "mtp/block/", 1) for p in row.ours))
                  for row in table if row.ours[0].startswith("layers/moe/"))
    return block + _rows(("mtp/e_norm/scale", "model.layers.{i}.enorm.weight", VECTOR),
                         ("mtp/h_norm/scale", "model.layers.{i}.hnorm.weight", VECTOR),
                         ("mtp/proj", "model.layers.{i}.eh_proj.weight", LINEAR),
                         ("mtp/final_norm/scale", "model.layers.{i}.shared_head.norm.weight", VECTOR))


# A prediction module's copies of the shared tensors: its HF name -> the model's parameter.
PREDICTION_COPIES = {"model.layers.{i}.embed_tokens.weight": "embed",
                     "model.layers.{i}.shared_head.head.weight": "head"}

_QKV = ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv")
_QKV_BIAS = ("layers/attn/bias_q", "layers/attn/bias_k", "layers/attn/bias_v")

_LLAMA = _rows(
    ("embed", "model.embed_tokens.weight", MATRIX),
    ("head", "lm_head.weight", LINEAR),
    ("final_norm/scale", "model.norm.weight", VECTOR),
    ("layers/attn_norm/scale", "model.layers.{i}.input_layernorm.weight", VECTOR),
    ("layers/attn/wq", "model.layers.{i}.self_attn.q_proj.weight", LINEAR),
    ("layers/attn/wk", "model.layers.{i}.self_attn.k_proj.weight", LINEAR),
    ("layers/attn/wv", "model.layers.{i}.self_attn.v_proj.weight", LINEAR),
    ("layers/attn/wo", "model.layers.{i}.self_attn.o_proj.weight", LINEAR, 2),
    ("layers/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight", VECTOR),
    ("layers/mlp/w_gate", "model.layers.{i}.mlp.gate_proj.weight", LINEAR),
    ("layers/mlp/w_up", "model.layers.{i}.mlp.up_proj.weight", LINEAR),
    ("layers/mlp/w_down", "model.layers.{i}.mlp.down_proj.weight", LINEAR),
)
# Llama's with multi-head latent attention's tensors (DeepSeek-V3; models.latent) for its attention's.
_LATENT = tuple(row for row in _LLAMA if not row.ours[0].startswith("layers/attn/")) + _rows(
    ("layers/attn/wq", "model.layers.{i}.self_attn.q_proj.weight", LINEAR),
    ("layers/attn/wq_a", "model.layers.{i}.self_attn.q_a_proj.weight", LINEAR),
    ("layers/attn/q_norm/scale", "model.layers.{i}.self_attn.q_a_layernorm.weight", VECTOR),
    ("layers/attn/wq_b", "model.layers.{i}.self_attn.q_b_proj.weight", LINEAR),
    (("layers/attn/wkv_a", "layers/attn/wk_rope"), "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", LINEAR),
    ("layers/attn/kv_norm/scale", "model.layers.{i}.self_attn.kv_a_layernorm.weight", VECTOR),
    ("layers/attn/wkv_b", "model.layers.{i}.self_attn.kv_b_proj.weight", LINEAR),
    ("layers/attn/wo", "model.layers.{i}.self_attn.o_proj.weight", LINEAR, 2),
)
# The parameters whose last axis ends in rotary dimensions (models.latent): DeepSeek's
# checkpoints store those in interleaved pairs (rope_interleave), ours rotate halves.
ROTARY_TAILS = ("attn/wq", "attn/wq_b", "attn/wk_rope")
_QK_NORMS = _rows(*((f"layers/attn/{x}_norm/scale", f"model.layers.{{i}}.self_attn.{x}_norm.weight", VECTOR)
                    for x in "qk"))
# Gemma's four norms a layer: HF's post_attention_layernorm is the norm after attention, not before the MLP.
_GEMMA = tuple(row for row in _LLAMA if row.ours != ("layers/mlp_norm/scale",)) + _rows(
    ("layers/attn_post_norm/scale", "model.layers.{i}.post_attention_layernorm.weight", VECTOR),
    ("layers/mlp_norm/scale", "model.layers.{i}.pre_feedforward_layernorm.weight", VECTOR),
    ("layers/mlp_post_norm/scale", "model.layers.{i}.post_feedforward_layernorm.weight", VECTOR),
)
_DEEPSEEK = _moe_table(_LATENT, "model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts",
                       {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}) + _rows(
    ("layers/moe/mlp/bias_balance", "model.layers.{i}.mlp.gate.e_score_correction_bias", VECTOR),
    *((f"layers/moe/mlp/shared/{ours}", f"model.layers.{{i}}.mlp.shared_experts.{theirs}.weight", LINEAR)
      for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))))
TABLES: dict[str, tuple[Row, ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA + _rows(*((bias, f"model.layers.{{i}}.self_attn.{name}_proj.bias", VECTOR)
                              for bias, name in zip(_QKV_BIAS, "qkv"))),
    "qwen3": _LLAMA + _QK_NORMS,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA + _QK_NORMS,
    "mixtral": _moe_table(_LLAMA, "model.layers.{i}.block_sparse_moe.gate.weight",
                          "model.layers.{i}.block_sparse_moe.experts", {"w_gate": "w1", "w_down": "w2", "w_up": "w3"}),
    "qwen3_moe": _moe_table(_LLAMA + _QK_NORMS, "model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts",
                            {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
    "deepseek_v3": _DEEPSEEK + _prediction_rows(_DEEPSEEK),
    "gpt2": _rows(
        ("embed", "transformer.wte.weight", MATRIX),
        ("pos_embed", "transformer.wpe.weight", MATRIX),
        ("head", "lm_head.weight", LINEAR),
        ("final_norm/scale", "transformer.ln_f.weight", VECTOR),
        ("final_norm/bias", "transformer.ln_f.bias", VECTOR),
        ("layers/attn_norm/scale", "transformer.h.{i}.ln_1.weight", VECTOR),
        ("layers/attn_norm/bias", "transformer.h.{i}.ln_1.bias", VECTOR),
        (_QKV, "transformer.h.{i}.attn.c_attn.weight", MATRIX),
        (_QKV_BIAS, "transformer.h.{i}.attn.c_attn.bias", VECTOR),
        ("layers/attn/wo", "transformer.h.{i}.attn.c_proj.weight", MATRIX, 2),
        ("layers/attn/bias_o", "transformer.h.{i}.attn.c_proj.bias", VECTOR),
        ("layers/mlp_norm/scale", "transformer.h.{i}.ln_2.weight", VECTOR),
        ("layers/mlp_norm/bias", "transformer.h.{i}.ln_2.bias", VECTOR),
        ("layers/mlp/w_in", "transformer.h.{i}.mlp.c_fc.weight", MATRIX),
        ("layers/mlp/bias_in", "transformer.h.{i}.mlp.c_fc.bias", VECTOR),
        ("layers/mlp/w_out", "transformer.h.{i}.mlp.c_proj.weight", MATRIX),
        ("layers/mlp/bias_out", "transformer.h.{i}.mlp.c_proj.bias", VECTOR),
    ),
}

# Tensors HF checkpoints may carry that hold no parameter: the causal-mask buffers of older
# GPT-2 saves and the RoPE frequencies of older Llama saves (we recompute both).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# A multimodal checkpoint (Gemma 3 4B and up) keeps its text model under one of these in place of
# `model.` (transformers' saves, 4.5x and 5.x alike, and its own in-memory names), its vision
# encoder and projector (not imported) under the others.
TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
OTHER_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
               "language_model.lm_head.")


def rows_for(family: str, paths: set[str]) -> tuple[Row, ...]:
    """The family's rows whose parameters the model has (no `head` when tied, ...)."""
    return tuple(row for row in TABLES[family] if row.ours[0] in paths)


def holds_prediction(family: str) -> bool:
    """Whether the family's checkpoints store multi-token prediction modules (DeepSeek-V3's)."""
    return any(row.ours[0].startswith(PREDICTION) for row in TABLES[family])


@dataclasses.dataclass(frozen=True)
class Spacing:
    """Where a mixture-of-experts model's stacks sit among HF's layers: model.moe.first_dense
    dense layers (layers/first), then groups of every_n layers, n-1 dense (layers/dense), then
    one MoE layer (layers/moe). A dense model's one stack is `Spacing()`. Multi-token prediction
    modules (mtp) follow the model's `layers`."""

    every_n: int = 1
    first: int = 0
    layers: int = 0

    @classmethod
    def of(cls, spec) -> Spacing:
        """The spacing of a model of `spec` (its model.moe and depth)."""
        return cls(spec.moe.every_n_layers, spec.moe.first_dense, spec.num_layers)


def hf_layer(row: Row, index: int, spacing: Spacing = Spacing()) -> int:
    """HF's layer number of slice `index` of the row's stacked parameter: see Spacing."""
    n, first = spacing.every_n, spacing.first
    if row.ours[0].startswith(PREDICTION):
        return spacing.layers + index
    if row.ours[0].startswith("layers/moe/"):
        return first + index * n + n - 1
    if row.ours[0].startswith("layers/dense/"):
        return first + index // (n - 1) * n + index % (n - 1)
    return index


def hf_name(row: Row, layer: int | None, spacing: Spacing = Spacing(), expert: int | None = None) -> str:
    """The HF tensor of the row for our stacked slice `layer` (and `expert` of an experts row)."""
    return row.hf.format(i=hf_layer(row, layer, spacing), e=expert) if row.stacked else row.hf


def _rotary_order(width: int) -> np.ndarray:
    """Where each of our rotary dimensions sits in DeepSeek's interleaved pairs: our halves'
    first (cos) components are its even dimensions, the second its odd ones."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


def deinterleave(value: np.ndarray, width: int) -> np.ndarray:
    """An HF value (in our shape) whose last axis ends in `width` interleaved rotary dimensions,
    with them in our rotate-half order."""
    order = np.concatenate([np.arange(value.shape[-1] - width), value.shape[-1] - width + _rotary_order(width)])
    return np.ascontiguousarray(value[..., order])


def interleave(value: np.ndarray, width: int) -> np.ndarray:
    """The inverse of `deinterleave`: our value with its rotary tail in DeepSeek's pairs."""
    order = np.concatenate([np.arange(value.shape[-1] - width),
                            value.shape[-1] - width + np.argsort(_rotary_order(width))])
    return np.ascontiguousarray(value[..., order])


def to_ours(hf_part: np.ndarray, row: Row, shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor (or the part of a fused one that holds this parameter), of any float dtype, in
    our per-layer shape in float32: converted and transposed in at most one copy."""
    value = hf_part.T if row.kind == LINEAR else hf_part
    if value.dtype == np.float32 and value.flags.c_contiguous:
        return value.reshape(shape)  # already laid out: no copy
    out = np.empty(shape, np.float32)
    np.copyto(out.reshape(value.shape), value, casting="unsafe")
    return out


def to_hf(ours: np.ndarray, row: Row) -> np.ndarray:
    """Our per-layer value in HF's layout (a part of it when HF fuses several parameters)."""
    if row.kind == VECTOR:
        return ours.reshape(-1)
    matrix = ours.reshape(math.prod(ours.shape[:row.in_dims]), -1)
    return np.ascontiguousarray(matrix.T if row.kind == LINEAR else matrix)


def tensor_shape(row: Row, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The part of our per-layer `shape` one HF tensor of the row holds: one expert's of an experts row."""
    return shape[1:] if row.experts else shape


def hf_part_sizes(row: Row, shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Length along HF's output axis of each part of the row (`shapes`: per-layer shapes of ours)."""
    in_dims = 0 if row.kind == VECTOR else row.in_dims
    return [math.prod(tensor_shape(row, shapes[path])[in_dims:]) for path in row.ours]


def hf_shape(row: Row, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape HF stores the row's tensor in (`shapes`: per-layer shapes of ours)."""
    out = sum(hf_part_sizes(row, shapes))
    if row.kind == VECTOR:
        return (out,)
    fan_in = math.prod(tensor_shape(row, shapes[row.ours[0]])[:row.in_dims])
    return (out, fan_in) if row.kind == LINEAR else (fan_in, out)
