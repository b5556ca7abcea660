"""Hugging Face `config.json` <-> jaxscale `model.*` fields, refusing what our model cannot compute.

Reads the legacy (transformers 4.x: `rope_theta`, `rope_scaling`) and current (5.x:
`rope_parameters`) spellings; writes the legacy one, which both read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxscale.errors import ConfigError
from jaxscale.models.families import preset
from jaxscale.models.rope import RopeScaling

# The model.* fields an HF config decides.
FIELDS = ("family", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size",
          "max_seq_len", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps")

# RoPE scaling: HF's rope type -> {its key: model.rope_scaling's}; other types and keys are refused.
_ORIGINAL = {"original_max_position_embeddings": "original_max_seq_len"}
ROPE_KEYS = {
    "default": {},
    "linear": {"factor": "factor"},
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               **_ORIGINAL},
    "yarn": {"factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
             "attention_factor": "attention_factor", "truncate": "truncate", **_ORIGINAL},
}

# Families built as Llama: model_type -> (transformers' class, config.json fields that say what we compute).
LLAMA_LIKE = {"llama": ("LlamaForCausalLM", dict(attention_bias=False, mlp_bias=False)),
              "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
              "qwen2": ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=None)),
              "qwen3": ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=None, attention_bias=False))}

# HF settings our model computes at these values only: field -> (supported values, HF's default, why).
SUPPORTED = {
    "llama": {
        "hidden_act": (("silu",), "silu", "jaxscale's llama MLP is SwiGLU with silu"),
        "attention_bias": ((False,), False, "jaxscale's llama attention has no biases"),
        "mlp_bias": ((False,), False, "jaxscale's llama MLP has no biases"),
    },
    "mistral": {  # HF's MistralConfig defaults to Mistral 7B v0.1's window of 4096
        "hidden_act": (("silu",), "silu", "jaxscale's mistral MLP is SwiGLU with silu"),
        "sliding_window": ((None,), 4096, "jaxscale has no sliding-window attention yet; checkpoints without "
                                          "one (sliding_window null: Mistral 7B v0.2 and later) import"),
    },
    "qwen2": {
        "hidden_act": (("silu",), "silu", "jaxscale's qwen2 MLP is SwiGLU with silu"),
        "use_sliding_window": ((False,), False, "jaxscale has no sliding-window attention yet"),
    },
    "qwen3": {
        "hidden_act": (("silu",), "silu", "jaxscale's qwen3 MLP is SwiGLU with silu"),
        "use_sliding_window": ((False,), False, "jaxscale has no sliding-window attention yet"),
        "attention_bias": ((False,), False, "jaxscale's qwen3 attention has no biases"),
    },
    "gpt2": {  # gelu_new and gelu_pytorch_tanh are both exactly our tanh-approximated GELU
        "activation_function": (("gelu_new", "gelu_pytorch_tanh"), "gelu_new",
                                "jaxscale's gpt2 MLP uses the tanh-approximated GELU"),
        "scale_attn_weights": ((True,), True, "jaxscale always scales attention scores by 1/sqrt(head_dim)"),
        "scale_attn_by_inverse_layer_idx": ((False,), False, "jaxscale's gpt2 has no per-layer attention scaling"),
        "add_cross_attention": ((False,), False, "jaxscale's gpt2 is decoder-only"),
    },
}


def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("hf_dir", str(hf_dir), "has no config.json; point it at a saved Hugging Face model directory")
    return json.loads(path.read_text())


def model_config_from_hf(hf_dir) -> dict:
    """jaxscale `model.*` fields (FIELDS) for the HF model in `hf_dir`.

    Raises ConfigError naming the HF field for settings our model cannot reproduce exactly.
    """
    hf = read_hf_config(hf_dir)
    family = hf.get("model_type")
    if family in LLAMA_LIKE:
        return _from_llama(hf, family)
    if family == "gpt2":
        return _from_gpt2(hf)
    raise ConfigError("model_type", family, "jaxscale imports Hugging Face models of type "
                      f"{', '.join(map(repr, [*LLAMA_LIKE, 'gpt2']))} only")


def _refuse_unless(ok: bool, field: str, value, fix: str):
    if not ok:
        raise ConfigError(field, value, fix)


def _refuse_unsupported(hf: dict, family: str) -> None:
    for field, (supported, default, why) in SUPPORTED[family].items():
        value = hf.get(field, default)
        _refuse_unless(value in supported, field, value, f"{why} (supported: {', '.join(map(repr, supported))})")


def _rope(hf: dict) -> tuple[float, dict]:
    """(rope_theta, every model.rope_scaling field) from either spelling (4.x: rope_theta and rope_scaling,
    5.x: rope_parameters); a rope type or key jaxscale does not compute is refused, naming it."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    _refuse_unless(rope_type in ROPE_KEYS, "rope_parameters.rope_type", rope_type,
                   f"jaxscale computes RoPE of types {', '.join(ROPE_KEYS)}; use a checkpoint with one of them")
    keys = ROPE_KEYS[rope_type]
    for key in sorted(set(params) - set(keys) - {"rope_type", "type", "rope_theta"}):
        _refuse_unless(params[key] is None, f"rope_parameters.{key}", params[key],
                       f"jaxscale's {rope_type} RoPE does not read it (it reads: {', '.join(keys) or 'nothing'})")
    scaling = {ours: params[theirs] for theirs, ours in keys.items() if params.get(theirs) is not None}
    if rope_type == "yarn" and "factor" not in scaling:  # DeepSeek's spelling: the ratio of the contexts
        scaling["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    scaling = RopeScaling(type="none" if rope_type == "default" else rope_type, **scaling)
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), dataclasses.asdict(scaling)


def _from_llama(hf: dict, family: str) -> dict:
    """Llama's structure and the families built as it (Mistral; Qwen2 with q, k, v biases; Qwen3
    with q, k norms). Heads may be wider or narrower than hidden_size / num_attention_heads."""
    _refuse_unsupported(hf, family)
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
    _refuse_unless(kinds == ["full_attention"], "layer_types", kinds, "jaxscale has no sliding-window attention yet")
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // heads
    theta, scaling = _rope(hf)
    return dict(family=family, num_layers=hf["num_hidden_layers"], d_model=d_model, num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=0 if head_dim * heads == d_model else head_dim, d_ff=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_theta=theta, rope_scaling=scaling,
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def _from_gpt2(hf: dict) -> dict:
    _refuse_unsupported(hf, "gpt2")
    d_model = hf["n_embd"]
    return dict(family="gpt2", num_layers=hf["n_layer"], d_model=d_model, num_heads=hf["n_head"],
                num_kv_heads=hf["n_head"], head_dim=0, d_ff=hf.get("n_inner") or 4 * d_model,
                vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                rope_theta=10000.0, rope_scaling=dataclasses.asdict(RopeScaling()),
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def _refuse_other_structure(spec) -> None:
    """HF's classes build their family's structure only: the spec's options must be its preset."""
    _refuse_unless(spec.arch == preset(spec.family), "architecture", spec.arch,
                   f"Hugging Face's {spec.family} is built as jaxscale's {spec.family} preset "
                   f"({preset(spec.family)}); a model with other options stays in jaxscale's format")


def hf_config_from_spec(spec) -> dict:
    """A config.json dict (its family's transformers config) describing the model `spec` builds."""
    _refuse_unless(not spec.moe.num_experts, "model.moe.num_experts", spec.moe.num_experts,
                   "Hugging Face export covers dense models; "
                   "a mixture-of-experts checkpoint stays in jaxscale's format")
    _refuse_other_structure(spec)
    if spec.family == "gpt2":
        _refuse_unless(spec.num_kv_heads == spec.num_heads, "model.num_kv_heads", spec.num_kv_heads,
                       f"Hugging Face GPT-2 has no grouped-query attention; set it to model.num_heads={spec.num_heads}")
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=spec.num_layers,
                    n_embd=spec.d_model, n_head=spec.num_heads, n_inner=spec.d_ff, vocab_size=spec.vocab_size,
                    n_positions=spec.max_seq_len, layer_norm_epsilon=spec.norm_eps, activation_function="gelu_new",
                    tie_word_embeddings=spec.tie_embeddings, initializer_range=spec.init_std, torch_dtype="float32")
    architecture, fields = LLAMA_LIKE[spec.family]
    return dict(model_type=spec.family, architectures=[architecture], num_hidden_layers=spec.num_layers,
                hidden_size=spec.d_model, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_size, intermediate_size=spec.d_ff, vocab_size=spec.vocab_size,
                max_position_embeddings=spec.max_seq_len, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
                hidden_act="silu", tie_word_embeddings=spec.tie_embeddings, initializer_range=spec.init_std,
                torch_dtype="float32", **fields, **_hf_rope_scaling(spec.rope_scaling))


def _hf_rope_scaling(scaling) -> dict:
    """config.json's rope_scaling for model.rope_scaling (none: no key, plain RoPE)."""
    if scaling.type == "none":
        return {}
    keys = {ours: theirs for theirs, ours in ROPE_KEYS[scaling.type].items()}
    values = {theirs: getattr(scaling, ours) for ours, theirs in keys.items()}
    if scaling.type == "yarn" and not scaling.attention_factor:
        values.pop("attention_factor")  # 0: derived from the factor, as HF derives it from None
    return {"rope_scaling": {"rope_type": scaling.type, **values}}


def check_spec_matches(spec, hf_dir) -> None:
    """Raise ConfigError naming the first model.* field where `spec` differs from the checkpoint."""
    hf = model_config_from_hf(hf_dir)
    # rope_theta means nothing without RoPE, and max_seq_len shapes a parameter only when positions are learned.
    position = preset(hf["family"]).position
    skip = {field for field, used in (("rope_theta", position == "rope"), ("rope_scaling", position == "rope"),
                                      ("max_seq_len", position == "learned")) if not used}
    hf["rope_scaling"] = RopeScaling(**hf["rope_scaling"])
    for field in FIELDS:
        if field not in skip and getattr(spec, field) != hf[field]:
            fix = f"the Hugging Face checkpoint in {hf_dir} has {hf[field]!r}; set model.{field}={hf[field]!r}"
            raise ConfigError(f"model.{field}", getattr(spec, field), fix)
    _refuse_other_structure(spec)
