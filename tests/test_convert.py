"""Hugging Face checkpoints in and out through the CLI: an imported model fine-tunes (on chat
records, with its tokenizer's own chat template) and resumes like any other, and its export loads
in transformers with matching logits, its tokenizer and template beside it."""

import json

import numpy as np
import pytest

from conftest import LazyModule, main_cli, run_cli
from jaxscale import config as config_lib
from jaxscale.checkpoint import load_params
from jaxscale.convert import to_hf
from jaxscale.models import model_from_config
from jaxscale.runtime.loop import train

torch = LazyModule("torch")
transformers = LazyModule("transformers")

TOKENS = np.random.default_rng(0).integers(0, 256, (1, 12))


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
CHATS = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                       {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(300)]


def _hf_llama(path):
    """A tiny random Llama as transformers saves it, with a byte-level BPE tokenizer.json (300
    tokens, EOS </s>) and a tokenizer_config.json holding its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([json.dumps(c) for c in CHATS], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}))
    return path


def test_import_fine_tune_resume_and_export(tmp_path):
    imported = tmp_path / "imported"
    done = main_cli(["from-hf", str(_hf_llama(tmp_path / "hf")), str(imported)], module="jaxscale.convert")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--config.checkpoint.init_from=" in done.stdout
    config = config_lib.load(str(imported / "config.json"))
    assert (config.model.d_model, config.model.num_kv_heads, config.model.tie_embeddings) == (64, 2, False)
    assert config.data.tokenizer.endswith("tokenizer.json")  # the checkpoint's own: its template beside it
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    config.data.path = str(tmp_path / "chats.jsonl")
    config.checkpoint.init_from = str(imported)
    config.train.update(steps=6, global_batch_size=8, seq_len=32, log_every=1, eval_every=0)
    config.metrics.progress = False
    config.tracking.update(writers="jsonl", report=False)
    first = train(config, tmp_path / "run", show_progress=False, until=3)
    rest = train(config, tmp_path / "run", show_progress=False)  # resumes its own checkpoint, not the import
    assert [r["step"] for r in first + rest] == [1, 2, 3, 4, 5, 6]
    assert first[0]["loss"] == pytest.approx(np.log(300), rel=0.05)  # the random HF weights: near uniform
    assert all(0 < r["trained_tokens"] < 8 * 32 for r in first + rest)  # the answers' tokens only

    exported = tmp_path / "exported"
    assert to_hf(str(tmp_path / "run"), exported) == 6
    assert json.loads((exported / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.numpy()
    trained, params, _ = load_params(str(tmp_path / "run"))
    ours = np.asarray(model_from_config(trained, "cpu")[0].apply(params, TOKENS))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_bad_convert_input_is_one_line():
    done = run_cli(["from-hf", "/no/such/dir", "/tmp/x"], module="jaxscale.convert", devices=1)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "HF_DIR='/no/such/dir'" in done.stderr


def _logits(model_dir, adapters=None):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if adapters is not None:
        hf = LazyModule("peft").PeftModel.from_pretrained(hf, adapters)
    with torch.no_grad():
        return hf.eval()(torch.tensor(TOKENS)).logits.numpy()


def test_lora_fine_tunes_an_import_resumes_and_exports_for_peft_and_merged(tmp_path):
    """LoRA (rank 4 on q, k, v, o, gate, up, down, dropout 0.1) on a Llama started from its Hugging
    Face directory (checkpoint.init_from=HF_DIR: converted once into WORKDIR/hf_import): its
    checkpoints hold the adapters and their optimizer state, not the base; a resume from step 2 in
    another workdir (converting the base again there) repeats the steps after it exactly, their
    dropout masks included; the adapters in
    PEFT's format, loaded by peft onto the transformers model, and the merged export each give
    jaxscale's logits."""
    import shutil

    hf = _hf_llama(tmp_path / "hf")
    config = config_lib.defaults()
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    config.data.path = str(tmp_path / "chats.jsonl")
    config.checkpoint.update(init_from=str(hf), every_steps=2)
    config.model.lora.update(rank=4, alpha=8.0, dropout=0.1)
    config.optim.update(lr=1e-2, warmup_steps=0)
    config.train.update(steps=4, global_batch_size=8, seq_len=32, log_every=1, eval_every=0)
    config.metrics.progress = False
    config.tracking.update(writers="jsonl", report=False)
    run = train(config, tmp_path / "run", show_progress=False)
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "2", tmp_path / "again" / "checkpoints" / "2")
    again = train(config, tmp_path / "again", show_progress=False)
    assert [r["loss"] for r in again] == [r["loss"] for r in run[2:]]  # bit-identical after the resume

    def size(path):
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    # The base (112,448 parameters) is not saved again: the adapters (8,192) and their moments are.
    assert size(tmp_path / "run" / "checkpoints" / "4") < size(tmp_path / "run" / "hf_import" / "checkpoints" / "0") / 2

    trained, params, _ = load_params(str(tmp_path / "run"))
    ours = np.asarray(model_from_config(trained, "cpu")[0].apply(params, TOKENS))
    assert np.abs(ours - _logits(hf)).max() > 1e-2  # the adapters changed the model
    to_hf(str(tmp_path / "run"), tmp_path / "peft", peft=True)
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"], adapter["base_model_name_or_path"]) == \
        (4, 8.0, 0.1, str(hf.absolute()))
    np.testing.assert_allclose(_logits(hf, tmp_path / "peft"), ours, atol=1e-4, rtol=0)
    to_hf(str(tmp_path / "run"), tmp_path / "merged")
    np.testing.assert_allclose(_logits(tmp_path / "merged"), ours, atol=1e-4, rtol=0)
