"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads onto the transformers model of the base checkpoint.

PEFT keeps each adapted nn.Linear's A as lora_A.weight [r, in] and B as lora_B.weight [out, r],
named after the Linear under `base_model.model.`; its output is scaled by lora_alpha / r, as
models.lora scales ours. The rows come from the family's HF table (interop.hf_names): each
targeted weight's row gives its adapters' rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from flax.traverse_util import flatten_dict

from jaxscale.errors import ConfigError
from jaxscale.interop import hf_files, stacked
from jaxscale.interop.hf_names import LINEAR, TABLES, Row, Spacing, hf_name, to_hf
from jaxscale.models.lora import PREFIX, weight_name

PEFT_PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def adapter_rows(family: str, paths: set[str]) -> tuple[Row, ...]:
    """The rows of the adapters at `paths` (<where>/<PREFIX><name>_a and _b): lora_A and lora_B of
    the HF Linear that holds their weight, <where>/weight_name(name). None for a weight HF fuses
    with others or stores otherwise (a GPT-2's Conv1D)."""
    linear = {row.ours[0]: row for row in TABLES[family]
              if row.kind == LINEAR and len(row.ours) == 1 and row.stacked and not row.experts}
    rows = []
    for a in sorted(path for path in paths if path.endswith("_a")):
        where, leaf = a.rsplit("/", 1)
        name = leaf[len(PREFIX):-len("_a")]
        row = linear.get(f"{where}/{weight_name(name)}")
        if row is not None:
            module = PEFT_PREFIX + row.hf.removesuffix(".weight")
            rows += [Row((a,), f"{module}.lora_A.weight", LINEAR, row.in_dims),
                     Row((f"{where}/{PREFIX}{name}_b",), f"{module}.lora_B.weight", LINEAR, 1)]
    return tuple(rows)


def save_peft(adapters: dict, spec, out_dir, base_model: str = "") -> Path:
    """Write the adapters (models.lora.split's first half of a parameter tree) of a model of
    `spec` as a PEFT LoRA adapter in out_dir; returns the weights file."""
    flat = flatten_dict(adapters, sep="/")
    rows = adapter_rows(spec.family, set(flat))
    if len(rows) != len(flat):
        raise ConfigError("model.family", spec.family, "its adapters have no PEFT names (a GPT-2 fuses q, k and v "
                          "in one Conv1D); export the merged model instead: to-hf without --peft")
    spacing = Spacing.of(spec)
    tensors = {}
    for row in rows:
        value = flat[row.ours[0]]
        for layer in range(value.shape[0]):
            tensors[hf_name(row, layer, spacing)] = to_hf(stacked.fetch(value, layer), row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_files.write_shard(out / WEIGHTS, tensors)
    modules = sorted({row.hf.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for row in rows
                      if row.hf.endswith(".lora_A.weight")})
    lora = spec.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out / WEIGHTS
