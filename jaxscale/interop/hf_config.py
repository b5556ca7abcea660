"""Hugging Face `config.json` <-> jaxscale `model.*` fields, refusing what our model cannot compute.

Reads the legacy (transformers 4.x: `rope_theta`, `rope_scaling`) and current (5.x:
`rope_parameters`) spellings; writes the legacy one, which both read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxscale.errors import ConfigError
from jaxscale.interop.hf_names import holds_prediction
from jaxscale.models.families import expand, period, preset
from jaxscale.models.rope import RopeScaling

# The model.* fields an HF config decides.
FIELDS = ("family", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size",
          "max_seq_len", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps", "layer_pattern",
          "sliding_window", "local_rope_theta", "query_scale", "attn_logit_softcap", "final_logit_softcap")
# What a model without sliding windows, soft-caps or another attention scale has in those fields.
PLAIN_ATTENTION = dict(layer_pattern="G", sliding_window=0, local_rope_theta=0.0, query_scale=0.0,
                       attn_logit_softcap=0.0, final_logit_softcap=0.0)
# HF's layer_types -> model.layer_pattern's letters.
LAYER_TYPES = {"full_attention": "G", "sliding_attention": "L"}

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
              "mistral": ("MistralForCausalLM", {}),
              "qwen2": ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=None)),
              "qwen3": ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=None, attention_bias=False))}

# Mixtures of experts: model_type (jaxscale's family) -> (transformers' class, config.json's expert count
# (transformers 5 writes Qwen3-MoE's as num_local_experts, 4.x and the released checkpoints num_experts;
# both read either), the dense relative whose fields and checks its attention and norms take).
MOE = {"mixtral": ("MixtralForCausalLM", "num_local_experts", "mistral"),
       "qwen3_moe": ("Qwen3MoeForCausalLM", "num_experts", "qwen3")}
# The model.moe.* fields a Hugging Face checkpoint decides (the others only shape training).
MOE_FIELDS = ("num_experts", "top_k", "d_ff", "every_n_layers", "renormalize", "first_dense", "num_shared", "score",
              "expert_groups", "top_groups", "routed_scale", "selection_bias")
# DeepSeek-V3: its transformers class, and config.json <-> model.mla's fields.
DEEPSEEK = "DeepseekV3ForCausalLM"
MLA_FIELDS = {"kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "rope_head_dim",
              "qk_nope_head_dim": "nope_head_dim", "v_head_dim": "v_head_dim"}
# Windowed families: the sliding_window their config class defaults to.
WINDOWED = {"mistral": 4096, "mixtral": None}

# Gemma's families: jaxscale's name -> (HF's model_type, transformers' class, the period of HF's default layer_types).
GEMMA = {"gemma2": ("gemma2", "Gemma2ForCausalLM", "LG"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM", "LLLLLG")}
MODEL_TYPES = {model_type: family for family, (model_type, _, _) in GEMMA.items()}
# Multimodal checkpoints whose text model jaxscale imports: model_type -> the config's text part.
MULTIMODAL = {"gemma3": "text_config"}

# HF settings our model computes at these values only: field -> (supported values, HF's default, why).
SUPPORTED = {
    "llama": {
        "hidden_act": (("silu",), "silu", "jaxscale's llama MLP is SwiGLU with silu"),
        "attention_bias": ((False,), False, "jaxscale's llama attention has no biases"),
        "mlp_bias": ((False,), False, "jaxscale's llama MLP has no biases"),
    },
    "mistral": {
        "hidden_act": (("silu",), "silu", "jaxscale's mistral MLP is SwiGLU with silu"),
    },
    "qwen2": {
        "hidden_act": (("silu",), "silu", "jaxscale's qwen2 MLP is SwiGLU with silu"),
        "use_sliding_window": ((False,), False, "jaxscale reads Qwen's windows on no layers only "
                                                "(they depend on max_window_layers)"),
    },
    "qwen3": {
        "hidden_act": (("silu",), "silu", "jaxscale's qwen3 MLP is SwiGLU with silu"),
        "use_sliding_window": ((False,), False, "jaxscale reads Qwen's windows on no layers only "
                                                "(they depend on max_window_layers)"),
        "attention_bias": ((False,), False, "jaxscale's qwen3 attention has no biases"),
    },
    **{family: {
        "hidden_activation": (("gelu_pytorch_tanh",), "gelu_pytorch_tanh",
                              f"jaxscale's {family} MLP is GeGLU with the tanh-approximated GELU"),
        "attention_bias": ((False,), False, f"jaxscale's {family} attention has no biases"),
        "use_bidirectional_attention": ((None, False), None, "jaxscale's attention is causal"),
    } for family in GEMMA},
    "gpt2": {  # gelu_new and gelu_pytorch_tanh are both exactly our tanh-approximated GELU
        "activation_function": (("gelu_new", "gelu_pytorch_tanh"), "gelu_new",
                                "jaxscale's gpt2 MLP uses the tanh-approximated GELU"),
        "scale_attn_weights": ((True,), True, "jaxscale always scales attention scores by 1/sqrt(head_dim)"),
        "scale_attn_by_inverse_layer_idx": ((False,), False, "jaxscale's gpt2 has no per-layer attention scaling"),
        "add_cross_attention": ((False,), False, "jaxscale's gpt2 is decoder-only"),
    },
}

# A mixture of experts is checked as its dense relative is, and for its router's settings.
SUPPORTED["mixtral"] = {**SUPPORTED["mistral"],
                        "router_jitter_noise": ((0, 0.0), 0.0, "jaxscale's router adds no noise to its inputs")}
SUPPORTED["qwen3_moe"] = {**SUPPORTED["qwen3"], "mlp_only_layers": (([],), [], "jaxscale places MoE layers every "
                                                                        "decoder_sparse_step layers only")}
# DeepSeek-V3's original config.json says how it routes; transformers' class computes these only.
SUPPORTED["deepseek_v3"] = {
    "hidden_act": (("silu",), "silu", "jaxscale's deepseek_v3 MLP is SwiGLU with silu"),
    "attention_bias": ((False,), False, "jaxscale's latent attention has no biases"),
    "scoring_func": (("sigmoid",), "sigmoid", "transformers' DeepSeek-V3 scores experts by sigmoid"),
    "topk_method": (("noaux_tc",), "noaux_tc", "transformers' DeepSeek-V3 selects by group-limited top-k with "
                                               "the correction bias"),
    "moe_layer_freq": ((1,), 1, "transformers' DeepSeek-V3 has experts in every layer after the first dense ones"),
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
    if hf.get("model_type") in MULTIMODAL:  # its text model (transformers saves the text part whole)
        hf = hf[MULTIMODAL[hf["model_type"]]]
    family = hf.get("model_type")
    if family in LLAMA_LIKE:
        return _from_llama(hf, family)
    if family in MOE:
        return _from_moe(hf, family)
    if family == "deepseek_v3":
        return _from_deepseek(hf)
    if family in MODEL_TYPES:
        return _from_gemma(hf, MODEL_TYPES[family])
    if family == "gpt2":
        return _from_gpt2(hf)
    raise ConfigError("model_type", family, "jaxscale imports Hugging Face models of type "
                      f"{', '.join(map(repr, [*LLAMA_LIKE, *MOE, 'deepseek_v3', *MODEL_TYPES, 'gpt2']))} only, "
                      "and the text "
                      f"model of {', '.join(map(repr, MULTIMODAL))}")


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


def _shape(hf: dict, family: str, tied_by_default: bool) -> dict:
    """The fields of a RoPE model in transformers' usual names (Llama's, Gemma's)."""
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // heads
    return dict(family=family, num_layers=hf["num_hidden_layers"], d_model=d_model, num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=0 if head_dim * heads == d_model else head_dim, d_ff=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", tied_by_default)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), **PLAIN_ATTENTION)


def _from_llama(hf: dict, family: str) -> dict:
    """Llama's structure and the families built as it (Mistral, with a window on every layer
    where it has one; Qwen2 with q, k, v biases; Qwen3 with q, k norms). Heads may be wider or
    narrower than hidden_size / num_attention_heads."""
    _refuse_unsupported(hf, family)
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
    _refuse_unless(kinds == ["full_attention"], "layer_types", kinds,
                   f"jaxscale reads {family}'s sliding windows from sliding_window only")
    fields = _shape(hf, family, tied_by_default=False)
    fields["rope_theta"], fields["rope_scaling"] = _rope(hf)
    window = hf.get("sliding_window", WINDOWED[family]) if family in WINDOWED else None
    return {**fields, **(dict(layer_pattern="L", sliding_window=int(window)) if window else {})}


def _from_moe(hf: dict, family: str) -> dict:
    """Mixtral and Qwen3-MoE: their dense relative's attention and norms, an MoE MLP every
    decoder_sparse_step layers (Mixtral: every layer) of softmax top-k experts, dropless (as
    transformers computes them). The load-balancing loss takes router_aux_loss_coef, no z-loss."""
    fields = _from_llama(hf, family)
    renormalize = bool(hf.get("norm_topk_prob", True)) if family == "qwen3_moe" else True
    top_k = hf["num_experts_per_tok"]
    _refuse_unless(top_k > 1 or not renormalize, "num_experts_per_tok", top_k,
                   "jaxscale weighs a lone expert by its probability, not 1: import a top-1 model with "
                   "norm_topk_prob=false")
    moe = dict(num_experts=hf.get(MOE[family][1]) or hf["num_local_experts"], top_k=top_k, renormalize=renormalize,
               capacity_factor=0.0, d_ff=hf.get("moe_intermediate_size", hf["intermediate_size"]),
               every_n_layers=hf.get("decoder_sparse_step", 1), num_shared=0,
               aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_weight=0.0)
    return {**fields, "moe": moe}


def _mscale(factor: float, scale: float) -> float:
    """YaRN's magnitude of a context `factor` times the pretrained one (DeepSeek's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def _deepseek_rope(hf: dict, qk_head_dim: int) -> dict:
    """rope_theta, rope_scaling and query_scale of DeepSeek's RoPE: its YaRN's mscale and
    mscale_all_dim set sin and cos's magnitude (their ratio, where attention_factor is not
    given) and scale the attention scores by mscale(all_dim)^2 (query_scale = (N + R) / that^4)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    mscale, all_dim = params.pop("mscale", None), params.pop("mscale_all_dim", None)
    theta, scaling = _rope({**hf, "rope_scaling": None, "rope_parameters": params})
    factor, query_scale = scaling["factor"], 0.0
    if scaling["type"] == "yarn" and mscale and all_dim and not scaling["attention_factor"]:
        scaling["attention_factor"] = _mscale(factor, mscale) / _mscale(factor, all_dim)
    if scaling["type"] != "none" and all_dim:
        query_scale = qk_head_dim / _mscale(factor, all_dim) ** 4
    return dict(rope_theta=theta, rope_scaling=scaling, query_scale=query_scale)


def _from_deepseek(hf: dict) -> dict:
    """DeepSeek-V3 (and R1, V3.1: the same class): multi-head latent attention, first_k_dense_replace
    dense layers, then MoE layers of sigmoid-scored experts chosen by group-limited top-k with the
    correction bias, shared experts beside them, dropless. No auxiliary or z-loss (the bias
    balances). Its multi-token prediction modules (the layers past num_hidden_layers) import when
    model.mtp_depth asks for them (interop.hf_names: 0 by default, as transformers loads none)."""
    _refuse_unsupported(hf, "deepseek_v3")
    fields = _shape(hf, "deepseek_v3", tied_by_default=False)
    mla = {ours: hf[theirs] or 0 for theirs, ours in MLA_FIELDS.items()}
    fields.update(head_dim=0, num_kv_heads=fields["num_heads"], mla=mla,
                  **_deepseek_rope(hf, mla["nope_head_dim"] + mla["rope_head_dim"]))
    groups = hf.get("n_group") or 1
    moe = dict(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], capacity_factor=0.0,
               d_ff=hf["moe_intermediate_size"], every_n_layers=1, first_dense=hf.get("first_k_dense_replace") or 0,
               num_shared=hf.get("n_shared_experts") or 0, score="sigmoid",
               renormalize=bool(hf.get("norm_topk_prob", True)), expert_groups=groups,
               top_groups=hf.get("topk_group") or groups, routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
               selection_bias=True, aux_loss_weight=0.0, z_loss_weight=0.0)
    return {**fields, "moe": moe}


def _layer_pattern(hf: dict, default_period: str) -> str:
    """model.layer_pattern from HF's layer_types (absent: the family's default period), as its
    shortest repeating unit."""
    types = hf.get("layer_types") or [default_period[i % len(default_period)] for i in range(hf["num_hidden_layers"])]
    letters = [LAYER_TYPES.get(t, t) for t in types]
    unknown = sorted(set(letters) - set(LAYER_TYPES.values()))
    _refuse_unless(not unknown, "layer_types", unknown, f"jaxscale builds layers of types {', '.join(LAYER_TYPES)}")
    return period("".join(letters), len(letters))


def _gemma3_rope(hf: dict) -> dict:
    """Gemma 3's two RoPEs: rope_theta and rope_scaling of the global layers, local_rope_theta of
    the sliding-window ones (unscaled), from either spelling (5.x: rope_parameters per layer type)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        local = params.get("sliding_attention") or {}
        _refuse_unless(local.get("rope_type", "default") == "default", "rope_parameters.sliding_attention.rope_type",
                       local.get("rope_type"), "jaxscale's local layers rotate by plain RoPE")
        theta, scaling = _rope({"rope_parameters": params["full_attention"]})
        return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=float(local.get("rope_theta", 1e4)))
    theta, scaling = _rope({"rope_theta": 1e6, **hf})
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=float(hf.get("rope_local_base_freq", 1e4)))


def _from_gemma(hf: dict, family: str) -> dict:
    """Gemma 2 and Gemma 3 (text): sandwich norms, GeGLU, scaled embeddings, a layer pattern of
    sliding-window and global layers, soft-capped scores and logits, query_pre_attn_scalar (0
    where it is the head width)."""
    _refuse_unsupported(hf, family)
    fields = _shape(hf, family, tied_by_default=True)
    if family == "gemma3":
        fields.update(_gemma3_rope(hf))
    else:
        fields["rope_theta"], fields["rope_scaling"] = _rope(hf)
    pattern, scale = _layer_pattern(hf, GEMMA[family][2]), hf.get("query_pre_attn_scalar", 256)
    head_width = fields["head_dim"] or fields["d_model"] // fields["num_heads"]
    window = hf.get("sliding_window", 4096) if "L" in pattern else 0  # Gemma's configs default to 4096
    _refuse_unless(window is not None, "sliding_window", window, "layer_types has sliding_attention layers: give "
                   "their window")
    return {**fields, "layer_pattern": pattern, "sliding_window": int(window),
            "query_scale": 0.0 if scale == head_width else float(scale),
            "attn_logit_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
            "final_logit_softcap": float(hf.get("final_logit_softcapping") or 0.0)}


def _from_gpt2(hf: dict) -> dict:
    _refuse_unsupported(hf, "gpt2")
    d_model = hf["n_embd"]
    return dict(family="gpt2", num_layers=hf["n_layer"], d_model=d_model, num_heads=hf["n_head"],
                num_kv_heads=hf["n_head"], head_dim=0, d_ff=hf.get("n_inner") or 4 * d_model,
                vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                rope_theta=10000.0, rope_scaling=dataclasses.asdict(RopeScaling()),
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), **PLAIN_ATTENTION)


def _check_prediction(spec, hf_dir) -> None:
    """model.mtp_depth asks for at most the multi-token prediction modules the checkpoint stores
    (DeepSeek-V3's num_nextn_predict_layers; other families store none)."""
    stored = (read_hf_config(hf_dir).get("num_nextn_predict_layers") or 0) if holds_prediction(spec.family) else 0
    _refuse_unless(spec.mtp_depth <= stored, "model.mtp_depth", spec.mtp_depth,
                   f"the Hugging Face checkpoint in {hf_dir} stores {stored} multi-token prediction module(s); "
                   f"set model.mtp_depth to at most {stored}")


def _refuse_other_structure(spec) -> None:
    """HF's classes build their family's structure only: the spec's options must be its preset."""
    _refuse_unless(spec.arch == preset(spec.family), "architecture", spec.arch,
                   f"Hugging Face's {spec.family} is built as jaxscale's {spec.family} preset "
                   f"({preset(spec.family)}); a model with other options stays in jaxscale's format")


def hf_config_from_spec(spec) -> dict:
    """A config.json dict (its family's transformers config) describing the model `spec` builds."""
    experts, moe_families = bool(spec.moe.num_experts), (*MOE, "deepseek_v3")
    _refuse_unless(experts == (spec.family in moe_families), "model.moe.num_experts", spec.moe.num_experts,
                   f"Hugging Face's mixtures of experts are {', '.join(moe_families)}; its {spec.family} has "
                   f"{'experts' if spec.family in moe_families else 'no experts'}")
    _refuse_unless(spec.mla.on == (spec.family == "deepseek_v3"), "model.mla.kv_lora_rank", spec.mla.kv_lora_rank,
                   f"Hugging Face's latent attention is deepseek_v3's; its {spec.family} has "
                   f"{'it' if spec.family == 'deepseek_v3' else 'none'}")
    _refuse_other_structure(spec)
    if spec.family == "deepseek_v3":
        return _deepseek_fields(spec)
    if spec.family == "gpt2":
        _refuse_gemma_options(spec)
        _refuse_unless(period(spec.layer_pattern) == "G", "model.layer_pattern", spec.layer_pattern,
                       "Hugging Face GPT-2 has no sliding-window layers; set it to G")
        _refuse_unless(spec.num_kv_heads == spec.num_heads, "model.num_kv_heads", spec.num_kv_heads,
                       f"Hugging Face GPT-2 has no grouped-query attention; set it to model.num_heads={spec.num_heads}")
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=spec.num_layers,
                    n_embd=spec.d_model, n_head=spec.num_heads, n_inner=spec.d_ff, vocab_size=spec.vocab_size,
                    n_positions=spec.max_seq_len, layer_norm_epsilon=spec.norm_eps, activation_function="gelu_new",
                    tie_word_embeddings=spec.tie_embeddings, initializer_range=spec.init_std, torch_dtype="float32")
    common = dict(num_hidden_layers=spec.num_layers, hidden_size=spec.d_model, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_size, intermediate_size=spec.d_ff,
                  vocab_size=spec.vocab_size, max_position_embeddings=spec.max_seq_len, rms_norm_eps=spec.norm_eps,
                  rope_theta=spec.rope_theta, tie_word_embeddings=spec.tie_embeddings,
                  initializer_range=spec.init_std, torch_dtype="float32", **_hf_rope_scaling(spec.rope_scaling))
    if spec.family in GEMMA:
        return {**common, **_gemma_fields(spec)}
    _refuse_gemma_options(spec)
    pattern, windowed = period(spec.layer_pattern), spec.family in WINDOWED
    _refuse_unless(pattern == "G" or (windowed and pattern == "L"), "model.layer_pattern",
                   spec.layer_pattern, f"Hugging Face's {spec.family} has no sliding-window layers"
                   f"{' but on every layer (L)' if windowed else ''}")
    architecture, fields = _moe_fields(spec) if experts else LLAMA_LIKE[spec.family]
    window = dict(sliding_window=spec.sliding_window if pattern == "L" else None) if windowed else {}
    return {"model_type": spec.family, "architectures": [architecture], "hidden_act": "silu", **common, **fields,
            **window}


def _moe_fields(spec) -> tuple[str, dict]:
    """(transformers' class, config.json's expert fields) of a Mixtral or Qwen3-MoE `spec`: a
    softmax router without shared experts; Mixtral's in every layer, renormalising its top-k."""
    m = spec.moe
    for field, plain, why in (("num_shared", 0, "shared experts"), ("score", "softmax", "sigmoid scores"),
                              ("expert_groups", 1, "group-limited routing"), ("routed_scale", 1.0, "scaled weights")):
        _refuse_unless(getattr(m, field) == plain, f"model.moe.{field}", getattr(m, field),
                       f"Hugging Face's {spec.family} has no {why}; set it to {plain!r}")
    architecture, count, relative = MOE[spec.family]
    fields = {count: m.num_experts, "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_weight,
              "output_router_logits": False, **LLAMA_LIKE[relative][1]}
    if spec.family == "qwen3_moe":  # a lone expert weighs its probability here: HF's without renormalising
        return architecture, {**fields, "decoder_sparse_step": m.every_n_layers, "mlp_only_layers": [],
                              "moe_intermediate_size": m.d_ff or spec.d_ff,
                              "norm_topk_prob": m.renormalize and m.top_k > 1}
    _refuse_unless(m.every_n_layers == 1, "model.moe.every_n_layers", m.every_n_layers,
                   "Hugging Face's Mixtral has experts in every layer; set it to 1")
    _refuse_unless(m.renormalize and m.top_k > 1, "model.moe.renormalize", m.renormalize,
                   "Hugging Face's Mixtral renormalises its top-k (k > 1) weights; set it to True and top_k >= 2")
    return architecture, {**fields, "intermediate_size": m.d_ff or spec.d_ff, "router_jitter_noise": 0.0}


def _deepseek_fields(spec) -> dict:
    """config.json of a DeepSeek-V3 `spec`: latent attention, sigmoid-scored grouped experts with
    the correction bias in every layer after the first dense ones, rotary dimensions interleaved
    (as DeepSeek's checkpoints store them: interop.hf_names.interleave)."""
    m, mla = spec.moe, spec.mla
    needs = (("score", "sigmoid"), ("every_n_layers", 1), ("selection_bias", True))
    for field, value in needs + (("capacity_factor", 0.0),):
        _refuse_unless(getattr(m, field) == value, f"model.moe.{field}", getattr(m, field),
                       f"Hugging Face's DeepSeek-V3 computes {value!r} only; set it to {value!r}")
    _refuse_unless(not spec.attn_logit_softcap and not spec.final_logit_softcap, "model.attn_logit_softcap",
                   spec.attn_logit_softcap, "Hugging Face's DeepSeek-V3 has no soft-caps; set both to 0")
    scaling = spec.rope_scaling
    _refuse_unless(not spec.query_scale or scaling.type == "yarn", "model.query_scale", spec.query_scale,
                   "Hugging Face's DeepSeek-V3 scales scores by YaRN's mscale_all_dim only; set it to 0")
    rope = _hf_rope_scaling(scaling)
    if spec.query_scale:  # mscale_all_dim from the scores' scale, and mscale as the same (attention_factor kept)
        all_dim = 10 * ((mla.qk_head_dim / spec.query_scale) ** 0.25 - 1) / math.log(scaling.factor)
        rope["rope_scaling"].update(mscale=all_dim, mscale_all_dim=all_dim)
    return dict(model_type="deepseek_v3", architectures=[DEEPSEEK], hidden_act="silu",
                num_hidden_layers=spec.num_layers, hidden_size=spec.d_model, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_heads, intermediate_size=spec.d_ff, vocab_size=spec.vocab_size,
                max_position_embeddings=spec.max_seq_len, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
                tie_word_embeddings=spec.tie_embeddings, initializer_range=spec.init_std, torch_dtype="float32",
                **rope, **{theirs: getattr(mla, ours) or None for theirs, ours in MLA_FIELDS.items()},
                rope_interleave=True, attention_bias=False, n_routed_experts=m.num_experts,
                num_experts_per_tok=m.top_k, moe_intermediate_size=m.d_ff or spec.d_ff,
                first_k_dense_replace=m.first_dense, n_shared_experts=m.num_shared, norm_topk_prob=m.renormalize,
                n_group=m.expert_groups, topk_group=m.top_groups, routed_scaling_factor=m.routed_scale,
                num_nextn_predict_layers=spec.mtp_depth)


def _refuse_gemma_options(spec) -> None:
    """Llama's families in transformers have no attention scale, soft-caps or second RoPE."""
    for field in ("query_scale", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
        _refuse_unless(not getattr(spec, field), f"model.{field}", getattr(spec, field),
                       f"Hugging Face's {spec.family} has no such setting; set it to 0")


def _whole(x):
    """x as an int where it is one."""
    return int(x) if float(x).is_integer() else x


def _gemma_fields(spec) -> dict:
    """config.json's Gemma fields: the layer types, window, scale, soft-caps and (Gemma 3) local RoPE."""
    model_type, architecture, _ = GEMMA[spec.family]
    letters = {letter: name for name, letter in LAYER_TYPES.items()}
    fields = dict(model_type=model_type, architectures=[architecture], hidden_activation="gelu_pytorch_tanh",
                  layer_types=[letters[letter] for letter in expand(spec.layer_pattern, spec.num_layers)],
                  sliding_window=spec.sliding_window or None,
                  query_pre_attn_scalar=_whole(spec.query_scale or spec.head_size),  # transformers types it int
                  attn_logit_softcapping=spec.attn_logit_softcap or None,
                  final_logit_softcapping=spec.final_logit_softcap or None)
    if spec.family == "gemma2":
        _refuse_unless(not spec.local_rope_theta, "model.local_rope_theta", spec.local_rope_theta,
                       "Hugging Face's Gemma 2 rotates every layer alike; set it to 0")
        return fields
    _refuse_unless(bool(spec.local_rope_theta) or spec.rope_scaling.type == "none", "model.local_rope_theta",
                   spec.local_rope_theta, "Hugging Face's Gemma 3 scales the global layers' RoPE only; give the local "
                   "layers their own base (Gemma 3's is 10000)")
    return {**fields, "rope_local_base_freq": spec.local_rope_theta or spec.rope_theta}


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
    _check_prediction(spec, hf_dir)
    hf = model_config_from_hf(hf_dir)
    # rope_theta means nothing without RoPE, and max_seq_len shapes a parameter only when positions are learned.
    position = preset(hf["family"]).position
    skip = {field for field, used in (("rope_theta", position == "rope"), ("rope_scaling", position == "rope"),
                                      ("max_seq_len", position == "learned")) if not used}
    hf["rope_scaling"] = RopeScaling(**hf["rope_scaling"])
    for field in FIELDS:
        ours, theirs = getattr(spec, field), hf[field]
        if field == "layer_pattern":  # the same layers, however written
            ours, theirs = expand(ours, spec.num_layers), expand(theirs, spec.num_layers)
        if field not in skip and ours != theirs:
            fix = f"the Hugging Face checkpoint in {hf_dir} has {hf[field]!r}; set model.{field}={hf[field]!r}"
            raise ConfigError(f"model.{field}", getattr(spec, field), fix)
    for field, value in hf.get("mla", {"kv_lora_rank": 0}).items():
        if getattr(spec.mla, field) != value:
            raise ConfigError(f"model.mla.{field}", getattr(spec.mla, field), f"the Hugging Face checkpoint in "
                              f"{hf_dir} has {value!r}; set model.mla.{field}={value!r}")
    theirs = hf.get("moe", {"num_experts": 0})
    for field in (field for field in MOE_FIELDS if field in theirs):
        ours = getattr(spec.moe, field)
        ours = (ours or spec.d_ff) if field == "d_ff" else ours  # an expert's d_ff 0 is model.d_ff
        if ours != theirs[field]:
            raise ConfigError(f"model.moe.{field}", getattr(spec.moe, field), f"the Hugging Face checkpoint in "
                              f"{hf_dir} has {theirs[field]!r}; set model.moe.{field}={theirs[field]!r}")
    _refuse_other_structure(spec)
