"""CLI: Hugging Face checkpoints in and out.

    python -m jaxscale.convert from-hf HF_DIR OUT_DIR [--config.section.key=value ...]
    python -m jaxscale.convert to-hf CKPT HF_DIR [--peft]

from-hf reads a local Llama or GPT-2 checkpoint (config.json and safetensors) tensor by tensor
and writes OUT_DIR/config.json (the defaults with the model's shape, and its tokenizer.json when
the HF dir has one) and a parameters-only checkpoint in OUT_DIR/checkpoints/0. Train from it:

    python -m jaxscale.train --config=OUT_DIR/config.json --config.checkpoint.init_from=OUT_DIR --workdir=RUN

A run can also name the HF directory itself, checkpoint.init_from=HF_DIR (start_from_hf): it takes
the model's shape and tokenizer and converts the weights once into WORKDIR/hf_import.

to-hf writes the parameters of CKPT (a workdir, its checkpoints/ directory or one step's
directory; the newest committed step unless a step's directory is given) as an HF checkpoint
that transformers' AutoModelForCausalLM loads, with the run's tokenizer.json if it used one (and the
tokenizer_config.json, chat_template.jinja and special_tokens_map.json beside it). A LoRA run's
checkpoint (model.lora.rank > 0) is written merged: each adapter folded into its weight. With
--peft, only its adapters, in PEFT's format (adapter_config.json, adapter_model.safetensors),
for `peft.PeftModel.from_pretrained` on the base model.
Exit codes: 0 done, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from jaxscale import cli
from jaxscale.errors import ConfigError

TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
USAGE = ("usage: python -m jaxscale.convert from-hf HF_DIR OUT_DIR [--config.section.key=value ...]\n"
         "       python -m jaxscale.convert to-hf CKPT HF_DIR [--peft]")


def config_for_hf(hf_dir, config=None, overrides=(), say=print):
    """`config` (default: the defaults) with the model fields of the HF checkpoint, its
    tokenizer.json when the directory has one, then `overrides` ('a.b=value' strings). A GPT-2
    learns a fixed number of positions: a train.seq_len above them is lowered to them, and `say`
    gets one note line about it."""
    from jaxscale import config as config_lib
    from jaxscale.interop import model_config_from_hf
    from jaxscale.models.families import preset

    config = config_lib.defaults() if config is None else config
    config.model.update(model_config_from_hf(hf_dir))
    if (Path(hf_dir) / "tokenizer.json").exists():
        config.data.tokenizer = str(Path(hf_dir) / "tokenizer.json")
    config_lib.apply_overrides(config, list(overrides))
    positions = config.model.max_seq_len
    if preset(config.model.family).position == "learned" and config.train.seq_len > positions:
        say(f"note: train.seq_len={config.train.seq_len} is more than the {positions} positions the GPT-2 in "
            f"{hf_dir} learned (n_positions); training with train.seq_len={positions}")
        config.train.seq_len = positions
    return config


def from_hf(hf_dir, out_dir, config) -> int:
    """Write `config` and the HF weights as a parameters-only checkpoint (step 0) in out_dir;
    returns the number of parameters."""
    import jax

    from jaxscale import config as config_lib
    from jaxscale.checkpoint import Checkpointer
    from jaxscale.interop import load_hf_params
    from jaxscale.models import model_from_config

    model, _ = model_from_config(config, jax.default_backend())
    params = load_hf_params(hf_dir, model.spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config_lib.to_json(config))
    with Checkpointer(out / "checkpoints", config.checkpoint) as checkpointer:
        checkpointer.save(0, {"params": params}, {"global_sample": 0},
                          {"source": "huggingface", "hf_dir": str(Path(hf_dir).absolute())}, config.to_dict())
    return sum(x.size for x in jax.tree.leaves(params))


def to_hf(checkpoint: str, hf_dir, peft: bool = False) -> int:
    """Write a checkpoint's parameters as an HF checkpoint (a LoRA run's merged, or with `peft`
    its adapters alone in PEFT's format); returns the step exported."""
    import jax

    from jaxscale.checkpoint import load_params
    from jaxscale.interop import peft as peft_lib
    from jaxscale.interop import save_hf
    from jaxscale.models import lora, model_from_config

    config, params, step = load_params(checkpoint, field="CKPT")
    spec = model_from_config(config, jax.default_backend())[0].spec
    if peft:
        if not spec.lora.on:
            raise ConfigError("--peft", "True", f"{checkpoint} holds no adapters (model.lora.rank=0)")
        peft_lib.save_peft(lora.split(params)[0], spec, hf_dir, _base_model(config))
        return step
    save_hf(lora.folded(params, spec.lora), lora.without(spec), hf_dir)
    tokenizer = Path(config.data.tokenizer)
    if tokenizer.suffix == ".json" and tokenizer.exists():
        shutil.copy(tokenizer, Path(hf_dir) / "tokenizer.json")
        for name in TOKENIZER_FILES:  # its chat template and special tokens, where they are beside it
            if (tokenizer.parent / name).is_file():
                shutil.copy(tokenizer.parent / name, Path(hf_dir) / name)
    return step


def is_hf_dir(path) -> bool:
    """Whether `path` is a Hugging Face model directory (a config.json naming a model_type), not a
    jaxscale checkpoint or run."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except ValueError:
        return False


def start_from_hf(config, workdir, say=print):
    """`config` for a run in `workdir` whose checkpoint.init_from names a Hugging Face directory: a
    copy with the model's shape and tokenizer (config_for_hf), starting from its weights converted
    once into WORKDIR/hf_import (kept there: a resumed LoRA or DPO run reads its base from them
    again). Any other config is returned as it is. The conversion runs in one process; with
    several, convert first (python -m jaxscale.convert from-hf)."""
    import copy

    import jax

    hf_dir = config.checkpoint.init_from
    if not hf_dir or not is_hf_dir(hf_dir):
        return config
    if jax.process_count() > 1:
        raise ConfigError("checkpoint.init_from", hf_dir, "is a Hugging Face directory; with several processes "
                          "convert it first: python -m jaxscale.convert from-hf DIR OUT, then init_from=OUT")
    config = config_for_hf(hf_dir, copy.deepcopy(config), say=say)
    imported = Path(workdir) / "hf_import"
    if not (imported / "checkpoints").exists():
        say(f"converting {hf_dir} into {imported} (once; later runs in this workdir reuse it)")
        base = copy.deepcopy(config)
        base.model.lora.rank = 0  # the model's own weights: adapters start from the seed
        from_hf(hf_dir, imported, base)
    config.checkpoint.init_from = str(imported)
    return config


def _base_model(config) -> str:
    """The HF directory the run's base came from (the `hf_dir` that from-hf wrote beside
    checkpoint.init_from's parameters), or ''."""
    from jaxscale.checkpoint import Checkpointer, locate

    if not config.checkpoint.init_from:
        return ""
    directory, step = locate(config.checkpoint.init_from, "checkpoint.init_from")
    with Checkpointer(directory, config.checkpoint, read_only=True) as checkpointer:
        return checkpointer.read_json(checkpointer.latest_step() if step is None else step)[1].get("hf_dir", "")


def _command(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ("from-hf", "to-hf"):
        raise ConfigError("command", " ".join(argv[:1]), USAGE.replace("\n", " | "))
    command, source, destination, rest = argv[0], argv[1], argv[2], argv[3:]
    if not Path(source).exists():
        raise ConfigError("HF_DIR" if command == "from-hf" else "CKPT", source, "no such directory")
    if command == "to-hf":
        if rest not in ([], ["--peft"]):
            raise ConfigError("flag", rest[0], "to-hf takes only --peft: the checkpoint has its config")
        step = to_hf(source, destination, peft=bool(rest))
        what = "LoRA adapters (PEFT format)" if rest else "Hugging Face format"
        print(f"wrote step {step} of {source} to {destination} ({what})")
        return
    unknown = [flag for flag in rest if not flag.startswith("--config.")]
    if unknown:
        raise ConfigError("flag", unknown[0], USAGE.replace("\n", " | "))
    config = config_for_hf(source, overrides=[flag.removeprefix("--config.") for flag in rest])
    count = from_hf(source, destination, config)
    print(f"wrote {count / 1e6:,.1f}M parameters of {source} to {destination}; train from them with "
          f"--config={Path(destination) / 'config.json'} --config.checkpoint.init_from={destination}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(_command, USAGE, argv or ["--help"])


if __name__ == "__main__":
    cli.exit_process(main())
