"""Config loading, overrides and validation: every bad input is one line naming the field."""

import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from jaxscale import config as config_lib
from jaxscale.cli import parse_flags
from jaxscale.errors import ConfigError
from jaxscale.validate import validate


def _error(overrides, devices=8, config=None):
    config = config or config_lib.defaults()
    with pytest.raises(ConfigError) as info:
        config_lib.apply_overrides(config, overrides)
        validate(config, devices)
    return info.value


def test_defaults_and_shipped_configs_validate():
    validate(config_lib.defaults(), 8)
    for path in sorted((ROOT / "configs").glob("*.py")):
        validate(config_lib.load(str(path)), 8)


# The checkpoints' own parameter counts (their model cards and safetensors indexes), to the
# digits published: the configs build those models.
PUBLISHED_PARAMS = {"llama3_1_8b": 8.03e9, "llama_1b": 1.24e9, "mistral_7b": 7.25e9, "qwen3_8b": 8.19e9,
                    "qwen3_1_7b": 1.72e9, "gemma2_2b": 2.61e9, "gemma3_1b": 1.00e9, "mixtral_8x7b": 46.7e9,
                    "qwen3_30b_a3b": 30.5e9, "deepseek_v3_671b": 671e9,
                    "llama2_70b": 68.98e9}


@pytest.mark.parametrize("name", PUBLISHED_PARAMS)
def test_the_model_configs_have_their_checkpoints_parameter_counts(name):
    import jax

    from jaxscale.models import LanguageModel, ModelSpec

    shapes = LanguageModel(ModelSpec.from_config(config_lib.load(str(ROOT / "configs" / f"{name}.py")).model)).shapes
    shapes.pop("mtp", None)  # published counts are the model's, without its multi-token prediction modules
    count = sum(x.size for x in jax.tree.leaves(shapes))
    assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=5e-3), count


def test_loading_a_config_does_not_import_jax():
    code = "import sys, jaxscale.config; jaxscale.config.load('configs/tiny.py'); print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_overrides_parse_types():
    config = config_lib.defaults()
    config_lib.apply_overrides(config, ["train.steps=7", "optim.lr=1", "model.family=gpt2",
                                        "model.tie_embeddings=False", "data.path=a b.txt"])
    assert config.train.steps == 7 and config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.model.family == "gpt2" and config.model.tie_embeddings is False
    assert config.data.path == "a b.txt"


@pytest.mark.parametrize("text, value", [("true", True), ("False", False), ("TRUE", True), ("1", True), ("0", False),
                                         ("yes", True), ("No", False)])
def test_bool_overrides_take_the_words_absl_users_type(text, value):
    config = config_lib.defaults()
    config_lib.apply_overrides(config, [f"train.deterministic={text}", f"model.tie_embeddings={text}"])
    assert config.train.deterministic is value and config.model.tie_embeddings is value


def test_a_path_on_the_command_line_means_the_file_source():
    config = config_lib.load(str(ROOT / "configs" / "llama_1b.py"))
    assert config.data.source == "synthetic"
    config_lib.apply_overrides(config, ["data.path=train.bin"])
    assert config.data.source == "file"
    config = config_lib.load(str(ROOT / "configs" / "gpt2_124m.py"))
    config_lib.apply_overrides(config, ["data.mixture=web=a:0.7,code=b:0.3"])
    assert config.data.source == "file"
    config = config_lib.defaults()
    config_lib.apply_overrides(config, ["data.path=a.txt"])
    assert config.data.source == "auto"   # auto already reads the path
    config = config_lib.load(str(ROOT / "configs" / "llama_1b.py"))
    config_lib.apply_overrides(config, ["data.path=a.txt", "data.path="])
    assert config.data.source == "synthetic"   # no path in the end: the file's choice stands


@pytest.mark.parametrize("overrides, field, words", [
    (["train.deterministic=maybe"], "train.deterministic", "write true or false"),
    (["data.path=x.txt", "data.source=synthetic"], "data.source", "data.path or data.mixture is set"),
    (["train.stepz=5"], "train.stepz", "did you mean 'steps'"),
    (["trian.steps=5"], "trian.steps", "did you mean 'train'"),
    (["train.steps=abc"], "train.steps", "expected int"),
    (["model.tie_embeddings=3"], "model.tie_embeddings", "expected bool"),
    (["mesh.data=3"], "mesh.data", "8 are available"),
    (["mesh.data=-1", "mesh.tensor=-1"], "mesh.tensor", "only one axis may be -1"),
    (["mesh.pipeline=2", "model.num_layers=3"], "model.num_layers", "multiple of 2"),
    (["mesh.pipeline=4", "pipeline.microbatches=2"], "pipeline.microbatches", "at least 4"),
    (["mesh.pipeline=2", "pipeline.microbatches=3", "train.global_batch_size=16"], "pipeline.microbatches",
     "multiple of 12"),
    (["pipeline.schedule=zigzag"], "pipeline.schedule", "gpipe, circular, 1f1b"),
    (["pipeline.virtual_stages=2"], "pipeline.virtual_stages", "set it to 1"),
    (["pipeline.schedule=circular"], "pipeline.virtual_stages", "2 or more"),
    (["pipeline.schedule=file"], "pipeline.schedule_file", "needs the path of a schedule file"),
    (["mesh.pipeline=2", "pipeline.schedule=file", "pipeline.schedule_file=/nonexistent.txt"],
     "pipeline.schedule_file", "No such file"),
    (["mesh.pipeline=2", "mesh.sequence=2", "pipeline.schedule=1f1b"], "pipeline.schedule", "choose gpipe or circular"),
    (["mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.virtual_stages=2", "model.num_layers=6"],
     "model.num_layers", "multiple of 4"),
    (["mesh.data=2", "mesh.sequence=4", "train.seq_len=36", "model.max_seq_len=64"], "train.seq_len", "multiple of 8"),
    (["model.attention.impl=flash"], "model.attention.impl", "xla, cudnn, splash, auto"),
    (["model.rope_scaling.type=dynamic"], "model.rope_scaling.type", "none, linear, llama3, yarn"),
    (["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"], "model.rope_scaling.factor", ">= 1"),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.high_freq_factor=1"], "model.rope_scaling.high_freq_factor",
     "must exceed"),
    (["model.attention.context_parallel=tree"], "model.attention.context_parallel", "ring, all_gather, ulysses"),
    (["sharding.collective_matmul=yes"], "sharding.collective_matmul", "auto, on, off"),
    (["mesh.data=1", "mesh.tensor=8"], "model.num_heads", "split 8 ways"),
    (["mesh.data=1", "mesh.fsdp=8", "model.d_model=100", "model.num_heads=2", "model.num_kv_heads=2"],
     "model.d_model", "multiple of 8"),
    (["model.head_chunk_mib=-1"], "model.head_chunk_mib", ">= 0"),
    (["model.z_loss_weight=-1e-4"], "model.z_loss_weight", ">= 0"),
    (["mesh.data=4", "mesh.pipeline=2", "model.z_loss_weight=1e-4"], "model.z_loss_weight", "executor"),
    (["optim.grad_reduce_dtype=float16"], "optim.grad_reduce_dtype", "float32"),
    (["mesh.data=4", "mesh.tensor=2", "sharding.rules.length='sequence,tensor'", "train.seq_len=33",
      "model.max_seq_len=64"], "train.seq_len", "multiple of 2"),
    (["sharding.rules.embed='fsdp,bogus'"], "sharding.rules.embed", "not a mesh axis"),
    (["mesh_dcn.tensor=2", "mesh.data=4"], "mesh_dcn.tensor", "inside a host"),
    (["mesh_dcn.data=2", "mesh.data=4"], "mesh_dcn.data", "1 hosts"),
    (["zero_stage=5"], "zero_stage", "0, 1, 2 or 3"),
    (["checkpoint.local_every_steps=-2"], "checkpoint.local_every_steps", ">= 0"),
    (["checkpoint.local_dir='/ram/{host}'"], "checkpoint.local_dir", "only placeholder is {process}"),
    (["train.global_batch_size=12"], "train.global_batch_size", "multiple of 8"),
    (["train.grad_accum_steps=4", "train.global_batch_size=16"], "train.global_batch_size", "multiple of 32"),
    (["train.grad_accum_steps=3"], "train.grad_accum_steps", "must divide"),
    (["model.num_heads=3"], "model.num_heads", "must divide model.d_model"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "must divide model.num_heads"),
    (["model.family=mamba"], "model.family", "llama, gpt2"),
    (["model.remat=some"], "model.remat", "none, full, dots_saveable"),
    (["train.steps=0"], "train.steps", "> 0"),
    (["data.val_fraction=1.5"], "data.val_fraction", "between 0 and 1"),
    (["data.source=synthetic", "data.path=x.txt"], "data.source", "data.path or data.mixture is set"),
    (["model.family=gpt2", "train.seq_len=2048"], "train.seq_len", "max_seq_len"),
    (["model.layer_pattern=LX"], "model.layer_pattern", "G (global) or L (sliding window)"),
    (["model.layer_pattern=LG"], "model.sliding_window", "set their window"),
    (["model.attn_logit_softcap=-1"], "model.attn_logit_softcap", ">= 0"),
    (["model.layer_pattern=LG", "model.sliding_window=8", "model.moe.num_experts=4"], "model.layer_pattern",
     "one attention kind for every layer"),
    (["model.layer_pattern=LLG", "model.sliding_window=8", "mesh.data=4", "mesh.pipeline=2"],
     "model.layer_pattern", "multiple of 6"),
    (["model.layer_pattern=LG", "model.sliding_window=8", "mesh.data=4", "mesh.sequence=2"],
     "model.layer_pattern", "no sliding-window attention"),
    (["model.attn_logit_softcap=50", "mesh.data=4", "mesh.sequence=2"], "model.attn_logit_softcap",
     "do not soft-cap"),
    (["mesh.data=1", "mesh.sequence=8", "model.attention.context_parallel=ulysses"],
     "model.attention.context_parallel", "splits each device's 4 heads"),
    (["model.mla.kv_lora_rank=32", "model.num_kv_heads=2"], "model.num_kv_heads", "set it to model.num_heads=4"),
    (["model.mla.kv_lora_rank=32", "model.mla.rope_head_dim=7"], "model.mla.rope_head_dim", "even width"),
    (["model.mla.kv_lora_rank=32", "model.layer_pattern=LG", "model.sliding_window=8"], "model.layer_pattern",
     "no sliding-window layers"),
    (["model.mla.kv_lora_rank=30", "mesh.fsdp=4", "mesh.data=2"], "model.mla.kv_lora_rank", "split 4 ways"),
    (["model.mtp_depth=-1"], "model.mtp_depth", ">= 0"),
    (["sharding.overlap=sometimes"], "sharding.overlap", "auto, off, head, all"),
    (["model.mtp_depth=1", "mesh.data=4", "mesh.pipeline=2"], "model.mtp_depth", "set mesh.pipeline=1"),
    (["model.mtp_depth=1", "mesh.data=4", "mesh.sequence=2"], "model.mtp_depth", "set mesh.sequence=1"),
])
def test_bad_input_names_field(overrides, field, words):
    error = _error(overrides)
    message = str(error)
    assert error.field == field and message.startswith(field) and words in message
    assert "\n" not in message


def test_unknown_key_in_config_file():
    config = config_lib.defaults()
    with config.unlocked():
        config.train.warmup = 3
    error = _error([], config=config)
    assert error.field == "train.warmup"


def test_parse_flags():
    extra = {"workdir": str, "json": bool, "device_memory_gb": float}
    assert parse_flags(["--config=c.py", "--config.train.steps=5", "--workdir=w", "--json", "--device_memory_gb=80"],
                       "usage", extra) == ("c.py", ["train.steps=5"],
                                           {"workdir": "w", "json": True, "device_memory_gb": 80.0})
    with pytest.raises(ConfigError, match="--bogus"):
        parse_flags(["--config=c.py", "--bogus=1"], "usage", extra)
    with pytest.raises(ConfigError, match="expected float"):
        parse_flags(["--config=c.py", "--device_memory_gb=lots"], "usage", extra)


@pytest.mark.parametrize("flag, field", [("--config.train.stepz=5", "train.stepz"),
                                         ("--config.mesh.data=3", "mesh.data"),
                                         ("--config.data.path=/no/such/file.txt", "data.path"),
                                         ("--config.train.deterministic=maybe", "train.deterministic")])
def test_cli_bad_input_exits_2_with_one_line(flag, field, tmp_path):
    result = run_cli(["--config=configs/tiny.py", flag, f"--workdir={tmp_path}"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.stderr


def test_cli_missing_config_file_exits_2(tmp_path):
    result = run_cli([f"--config={tmp_path}/nope.py"])
    assert result.returncode == 2 and "--config" in result.stderr
