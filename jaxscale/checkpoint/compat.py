"""Whether a checkpoint fits the run restoring it: a different model shape is an error naming
the fields; a different mesh, process count or other model option is allowed and noted."""

from __future__ import annotations

from jaxscale.errors import ConfigError

# Fields that decide parameter shapes (and the guard's window, part of the state).
SHAPE_FIELDS = ("model.family", "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads",
                "model.d_ff", "model.vocab_size", "model.tie_embeddings", "model.mla", "model.moe.first_dense",
                "model.mtp_depth")
LEARNED_POSITION_FIELDS = ("model.max_seq_len",)  # the learned position table's length
STATE_FIELDS = ("guard.spike_window", "model.lora.rank", "model.lora.targets")  # (LoRA: the adapters' shapes)
# Model options that change the function but not the shapes: allowed, but said.
NOTED_FIELDS = ("model.rope_theta", "model.rope_scaling", "model.norm_eps", "model.layer_pattern",
                "model.sliding_window", "model.local_rope_theta", "model.query_scale", "model.attn_logit_softcap",
                "model.final_logit_softcap")


def _get(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _differences(saved: dict, current: dict, fields) -> list[tuple[str, object, object]]:
    return [(f, _get(saved, f), _get(current, f)) for f in fields
            if _get(saved, f) is not None and _get(saved, f) != _get(current, f)]


def check(saved: dict, current: dict, where: str, params_only: bool = False,
          learned_positions: bool = False) -> list[str]:
    """Raise ConfigError if `current` cannot hold the state saved with config `saved`; else
    return notes on allowed differences. `params_only`: only parameter shapes must match.
    `learned_positions`: the current model learns a position table (spec.arch.position)."""
    fields = SHAPE_FIELDS + (LEARNED_POSITION_FIELDS if learned_positions else ())
    fields += () if params_only else STATE_FIELDS
    wrong = _differences(saved, current, fields)
    if wrong:
        field, then, now = wrong[0]
        others = "".join(f"; also {f}: {a!r} in the checkpoint" for f, a, _ in wrong[1:])
        raise ConfigError(field, now, f"{where} was saved with {field}={then!r}{others}; use the checkpoint's "
                          "values, or a new --workdir (checkpoint.init_from needs matching model shapes too)")
    return [f"{f} is {now!r} but {where} was trained with {then!r}"
            for f, then, now in _differences(saved, current, NOTED_FIELDS)]


def describe_mesh(meta: dict) -> str:
    shape = " ".join(f"{k}={v}" for k, v in meta["mesh"].items() if v > 1) or "1 device"
    zero = f" zero_stage={meta['zero_stage']}" if meta.get("zero_stage") else ""
    processes = meta["processes"]
    return f"{shape}{zero} ({meta['devices']} devices, {processes} process{'es' if processes > 1 else ''})"
