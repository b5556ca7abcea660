"""The checks on the `model` settings: choices, sizes, shapes the layers can build, and the
mixture-of-experts settings against the mesh.

Config-level only (errors and names): checking a config never builds a model.
"""

from __future__ import annotations

from jaxscale.errors import require, require_choice, require_non_negative, require_positive
from jaxscale.models.families import head_size, period, preset
from jaxscale.names import (
    ATTENTION_IMPLS,
    DTYPES,
    FAMILIES,
    LAYER_LOOPS,
    PROJECTIONS,
    REMAT_POLICIES,
    ROPE_SCALINGS,
    ROUTER_SCORES,
    split_ways,
)

_SIZES = ("model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads", "model.d_ff",
          "model.vocab_size", "model.max_seq_len", "model.attention.block_size")


def check_model(config) -> None:
    """Known choices, positive sizes, and head/position shapes the layers support; raises
    ConfigError naming the field. The mixture-of-experts settings are `check_moe`'s."""
    m = config.model
    for field, value, choices in (("model.family", m.family, FAMILIES), ("model.remat", m.remat, REMAT_POLICIES),
                                  ("model.dtype", m.dtype, DTYPES), ("model.layer_loop", m.layer_loop, LAYER_LOOPS),
                                  ("model.projections", m.projections, PROJECTIONS),
                                  ("model.attention.impl", m.attention.impl, ATTENTION_IMPLS),
                                  ("model.rope_scaling.type", m.rope_scaling.type, ROPE_SCALINGS)):
        require_choice(field, value, choices)
    require_positive(config, _SIZES)
    require_non_negative(config, ("model.head_dim", "model.head_chunk_mib", "model.z_loss_weight", "model.mtp_depth",
                                  "model.mtp_loss_weight",
                                  "model.final_logit_softcap", "model.sliding_window", "model.local_rope_theta",
                                  "model.query_scale", "model.attn_logit_softcap"))
    _check_shapes(m, config.train.seq_len)
    _check_rope_scaling(m.rope_scaling)
    _check_layer_pattern(m)
    _check_latent(m)


def _check_latent(m) -> None:
    """Multi-head latent attention (model.mla.kv_lora_rank > 0): positive widths, an even rotary
    part, a head per query head, rotary positions and global layers only."""
    mla = m.mla
    require(mla.kv_lora_rank >= 0, "model.mla.kv_lora_rank", mla.kv_lora_rank, "must be >= 0 (0 = no latent)")
    if not mla.kv_lora_rank:
        return
    require(mla.q_lora_rank >= 0, "model.mla.q_lora_rank", mla.q_lora_rank, "must be >= 0 (0 = a full-rank query)")
    for key in ("nope_head_dim", "v_head_dim", "rope_head_dim"):
        require(mla[key] > 0, f"model.mla.{key}", mla[key], "must be > 0")
    require(mla.rope_head_dim % 2 == 0, "model.mla.rope_head_dim", mla.rope_head_dim,
            "RoPE rotates pairs of dimensions: use an even width")
    require(m.num_kv_heads == m.num_heads, "model.num_kv_heads", m.num_kv_heads,
            f"latent attention gives every query head its own key and value: set it to model.num_heads={m.num_heads}")
    require(preset(m.family).position == "rope", "model.family", m.family,
            "latent attention's positions are rotary: use a RoPE family (llama, deepseek_v3, ...)")
    require(set(m.layer_pattern) == {"G"}, "model.layer_pattern", m.layer_pattern,
            "latent attention has no sliding-window layers: set it to G")


def _check_layer_pattern(m) -> None:
    """A pattern of G and L layers, and a window wherever a layer is L."""
    pattern = m.layer_pattern
    require(bool(pattern) and set(pattern) <= {"G", "L"}, "model.layer_pattern", pattern,
            "write each layer's attention as G (global) or L (sliding window), e.g. LLLLLG")
    require("L" not in pattern or m.sliding_window > 0, "model.sliding_window", m.sliding_window,
            f"model.layer_pattern={pattern} has sliding-window layers: set their window")
    require(not m.moe.num_experts or len(period(pattern)) == 1, "model.layer_pattern", pattern,
            "mixture-of-experts models take one attention kind for every layer (G or L)")


def check_lora(config) -> None:
    """model.lora: a rank >= 0, known targets that the model's projections have, and adapters
    only where a projection is one dense weight (not latent attention's, not the experts')."""
    from jaxscale.models.layers import MLPS
    from jaxscale.models.lora import ATTENTION_TARGETS, LoraSpec

    m, spec = config.model, LoraSpec(**config.model.lora.to_dict())
    require(spec.rank >= 0, "model.lora.rank", spec.rank, "must be >= 0 (0 = no adapters: every parameter trains)")
    if not spec.on:
        return
    require(spec.alpha > 0, "model.lora.alpha", spec.alpha, "must be > 0 (the adapters are scaled by alpha / rank)")
    require(0 <= spec.dropout < 1, "model.lora.dropout", spec.dropout,
            "is the probability of dropping an adapter input: set it in [0, 1) (0 = no dropout)")
    require_choice("model.lora.base_dtype", spec.base_dtype, ("float32", "bfloat16"))
    kind = MLPS[preset(m.family).mlp]
    known = ATTENTION_TARGETS + (*kind.inputs, kind.output)
    for name in spec.target_names or ("",):
        require(name in known, "model.lora.targets", spec.targets,
                f"names projections from {', '.join(known)} (comma-separated); {name!r} is not one")
    require(not m.mla.kv_lora_rank, "model.lora.rank", spec.rank, "latent attention (model.mla) takes no adapters "
            "yet; set model.lora.rank=0")
    mlp = [name for name in spec.target_names if name not in ATTENTION_TARGETS]
    require(not (m.moe.num_experts and mlp), "model.lora.targets", spec.targets,
            "a mixture of experts' MLPs take no adapters yet; target attention alone (q,k,v,o)")
    require(not (m.moe.num_experts and m.moe.bias_rate), "model.moe.bias_rate", m.moe.bias_rate,
            "balancing by bias moves the router biases, which LoRA freezes; set it to 0")


def check_prediction(config, sizes) -> None:
    """Multi-token prediction (model.mtp_depth > 0) runs with neither a pipeline nor context
    parallelism."""
    m = config.model
    if not m.mtp_depth:
        return
    require(sizes["pipeline"] == 1, "model.mtp_depth", m.mtp_depth, "multi-token prediction runs after the "
            "model's last layer outside a pipeline schedule; set mesh.pipeline=1 (fsdp, expert and tensor "
            "layouts take it) or model.mtp_depth=0")
    require(sizes["sequence"] == 1, "model.mtp_depth", m.mtp_depth, "multi-token prediction shifts each row's "
            "tokens, which context parallelism lays out in zig-zag order; set mesh.sequence=1 or model.mtp_depth=0")


def check_layer_kinds(config, sizes) -> None:
    """How the layer pattern and soft-capping meet the mesh: a pipeline stage holds whole periods
    of the pattern; ring and all_gather context parallelism have no sliding window or soft-capping."""
    m = config.model
    p = len(period(m.layer_pattern))
    chunks = sizes["pipeline"] * config.pipeline.virtual_stages
    require(sizes["pipeline"] == 1 or (m.num_layers // chunks) % p == 0, "model.layer_pattern", m.layer_pattern,
            f"each of the {chunks} pipeline layer chunks must hold whole repeats of the {p}-layer pattern; "
            f"use model.num_layers a multiple of {chunks * p}")
    if sizes["sequence"] > 1 and m.attention.context_parallel != "ulysses":
        require("L" not in m.layer_pattern, "model.layer_pattern", m.layer_pattern, "ring and all_gather context "
                "parallelism (mesh.sequence > 1) have no sliding-window attention; set "
                "model.attention.context_parallel=ulysses, mesh.sequence=1 or a pattern of G only")
        require(not m.attn_logit_softcap, "model.attn_logit_softcap", m.attn_logit_softcap, "ring and all_gather "
                "context parallelism (mesh.sequence > 1) do not soft-cap attention scores; set "
                "model.attention.context_parallel=ulysses or mesh.sequence=1")


def _check_rope_scaling(r) -> None:
    """A scaled RoPE extends the context: factor >= 1, and llama3's band of wavelengths is not empty."""
    if r.type == "none":
        return
    require(r.factor >= 1, "model.rope_scaling.factor", r.factor, "must be >= 1 (the context grows by it)")
    require(r.original_max_seq_len > 0, "model.rope_scaling.original_max_seq_len", r.original_max_seq_len,
            "must be > 0: the context the model was pretrained on")
    require(r.type != "llama3" or r.high_freq_factor > r.low_freq_factor, "model.rope_scaling.high_freq_factor",
            r.high_freq_factor, f"must exceed model.rope_scaling.low_freq_factor={r.low_freq_factor}")


def _check_shapes(m, seq_len: int) -> None:
    """Heads split d_model evenly, query heads group over key/value heads, RoPE pairs dimensions,
    and learned positions cover every token (the family's options: models.families)."""
    arch = preset(m.family)
    require(m.head_dim > 0 or m.d_model % m.num_heads == 0, "model.num_heads", m.num_heads,
            f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
            f"must divide model.num_heads={m.num_heads} (grouped-query attention)")
    require(arch.position != "rope" or head_size(m) % 2 == 0, "model.num_heads", m.num_heads,
            f"RoPE needs an even head dimension; the heads are {head_size(m)} wide")
    require(arch.position != "learned" or seq_len <= m.max_seq_len, "train.seq_len", seq_len,
            f"{m.family} learns positions up to model.max_seq_len={m.max_seq_len}; raise it or shorten seq_len")


def check_moe(config, sizes, rules) -> None:
    """The `model.moe` settings, and how they meet the mesh (axis `sizes`) and the rule table;
    raises ConfigError naming the field to change."""
    m, experts = config.model.moe, sizes["expert"]
    require(m.num_experts >= 0, "model.moe.num_experts", m.num_experts, "must be >= 0 (0 = a dense model)")
    if not m.num_experts:
        require(experts == 1, "mesh.expert", experts, "expert parallelism splits the experts of MoE layers; set "
                f"model.moe.num_experts to a multiple of {experts}, or mesh.expert=1")
        return
    _check_router(m, config.model.num_layers)
    if sizes["pipeline"] > 1:
        require(m.first_dense == 0, "model.moe.first_dense", m.first_dense, "pipeline stages hold whole groups "
                "of layers alike, not first dense layers; set mesh.pipeline=1 (expert, fsdp and tensor layouts "
                "take it)")
        chunks, groups = sizes["pipeline"] * config.pipeline.virtual_stages, config.model.num_layers // m.every_n_layers
        require(groups % chunks == 0, "model.num_layers", config.model.num_layers,
                f"a pipeline stage holds whole groups of model.moe.every_n_layers={m.every_n_layers} layers; "
                f"{chunks} layer chunks need a multiple of {chunks * m.every_n_layers} layers")
        require(sizes["sequence"] == 1, "mesh.sequence", sizes["sequence"], "MoE layers in pipeline stages run "
                "under the schedule executor, which does not take context parallelism; set mesh.sequence=1")
    hidden = m.d_ff or config.model.d_ff
    parts, axes = split_ways(rules["mlp"], sizes)
    require(hidden % parts == 0, "model.moe.d_ff", m.d_ff,
            f"the experts' hidden size ({hidden}) is split {parts} ways ({axes}); use a multiple of {parts}")
    require(experts == 1 or "expert" in rules["batch"], "sharding.rules.batch", ",".join(rules["batch"]),
            f"mesh.expert={experts} exchanges tokens within each expert group, so the batch must be split "
            "over expert too; add expert")


def _check_router(m, num_layers: int) -> None:
    """Routing settings of an MoE model (num_experts > 0): top_k, capacity, layer spacing, weights."""
    require(1 <= m.top_k <= m.num_experts, "model.moe.top_k", m.top_k,
            f"must be between 1 and model.moe.num_experts={m.num_experts}")
    require(m.capacity_factor >= 0, "model.moe.capacity_factor", m.capacity_factor,
            "must be >= 0 (0 = dropless); a factor >= num_experts/top_k never drops a token either")
    require(0 <= m.first_dense < num_layers, "model.moe.first_dense", m.first_dense,
            f"must be >= 0 and leave MoE layers of model.num_layers={num_layers}")
    spaced = num_layers - m.first_dense
    require(m.every_n_layers >= 1 and spaced % m.every_n_layers == 0, "model.moe.every_n_layers",
            m.every_n_layers, f"must be >= 1 and divide model.num_layers={num_layers}"
            + (f" less model.moe.first_dense={m.first_dense}" if m.first_dense else ""))
    require(m.d_ff >= 0, "model.moe.d_ff", m.d_ff, "must be >= 0 (0 = model.d_ff)")
    require(m.num_shared >= 0, "model.moe.num_shared", m.num_shared, "must be >= 0 (0 = no shared experts)")
    require(m.hidden_chunk >= 0, "model.moe.hidden_chunk", m.hidden_chunk, "must be >= 0 (0 = the whole hidden width)")
    for key in ("aux_loss_weight", "z_loss_weight", "bias_rate"):
        require(m[key] >= 0, f"model.moe.{key}", m[key], "must be >= 0")
    require_choice("model.moe.score", m.score, ROUTER_SCORES)
    groups = m.expert_groups
    require(groups >= 1 and m.num_experts % groups == 0, "model.moe.expert_groups", groups,
            f"must be >= 1 and divide model.moe.num_experts={m.num_experts} (1 = no groups)")
    require(groups == 1 or m.num_experts // groups >= 2, "model.moe.expert_groups", groups,
            f"a group is scored by its 2 best experts; use at most {m.num_experts // 2} groups of "
            f"model.moe.num_experts={m.num_experts}, or 1")
    require(1 <= m.top_groups <= groups, "model.moe.top_groups", m.top_groups,
            f"must be between 1 and model.moe.expert_groups={groups}")
    allowed = m.top_groups * (m.num_experts // groups)
    require(m.top_k <= allowed, "model.moe.top_k", m.top_k,
            f"a token chooses among the experts of its model.moe.top_groups={m.top_groups} groups of "
            f"{m.num_experts // groups}: at most {allowed}; raise top_groups or lower top_k")
    require(m.routed_scale > 0, "model.moe.routed_scale", m.routed_scale, "must be > 0 (1 = the weights as routed)")
