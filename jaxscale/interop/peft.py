"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads onto the transformers model of the base checkpoint.

PEFT keeps each adapted nn.Linear's A as lora_A.weight [r, in] and B as lora_B.weight [out, r],
named after the Linear under `base_model.model.`; its output is scaled by lora_alpha / r, as
models.lora scales ours. The rows come from the family's HF table (interop.hf_names): each
targeted weight's row gives its adapters' rows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flax.traverse_util import flatten_dict

from jaxscale.errors import ConfigError
from jaxscale.interop import hf_files, stacked
from jaxscale.interop.hf_names import LINEAR, TABLES, Row, Spacing, hf_name, to_hf
from jaxscale.models.lora import PREFIX, WEIGHT_NAMES

PEFT_PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _target_of(path: str) -> str | None:
    """The adapter target whose weight is at `path` ("layers/attn/wq" -> "q"), or None."""
    leaf = path.rsplit("/", 1)[-1]
    by_weight = {weight: name for name, weight in WEIGHT_NAMES.items()}
    return by_weight.get(leaf, leaf[2:] if leaf.startswith("w_") else None)


def adapter_rows(family: str, paths: set[str]) -> tuple[Row, ...]:
    """The rows of the adapters at `paths`: lora_A and lora_B of each targeted HF Linear."""
    rows = []
    for row in TABLES[family]:
        if row.kind != LINEAR or len(row.ours) != 1 or row.experts or not row.stacked:
            continue
        where, name = row.ours[0].rsplit("/", 1)[0], _target_of(row.ours[0])
        a, b = f"{where}/{PREFIX}{name}_a", f"{where}/{PREFIX}{name}_b"
        if a in paths:
            module = PEFT_PREFIX + row.hf.removesuffix(".weight")
            rows += [Row((a,), f"{module}.lora_A.weight", LINEAR, row.in_dims),
                     Row((b,), f"{module}.lora_B.weight", LINEAR, 1)]
    return tuple(rows)


def save_peft(adapters: dict, spec, out_dir, base_model: str = "") -> Path:
    """Write the adapters (models.lora.split's first half of a parameter tree) of a model of
    `spec` as a PEFT LoRA adapter in out_dir; returns the weights file."""
    flat = {path: value for path, value in flatten_dict(adapters, sep="/").items()}
    rows = adapter_rows(spec.family, set(flat))
    if len(rows) != len(flat):
        raise ConfigError("model.family", spec.family, "its adapters have no PEFT names (a GPT-2 fuses q, k and v "
                          "in one Conv1D); export the merged model instead: to-hf without --peft")
    spacing = Spacing(spec.moe.every_n_layers, spec.moe.first_dense)
    tensors = {}
    for row in rows:
        value = flat[row.ours[0]]
        for layer in range(value.shape[0]):
            tensors[hf_name(row, layer, spacing)] = to_hf(stacked.fetch(value, layer), row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_files.write_shard(out / WEIGHTS, tensors)
    modules = sorted({row.hf.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
                      for row in rows})
    lora = spec.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": modules,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out / WEIGHTS


def without_adapters(spec):
    """`spec` with no adapters: the merged model's."""
    from jaxscale.models.lora import LoraSpec

    return dataclasses.replace(spec, lora=LoraSpec())
