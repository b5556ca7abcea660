"""The notebook API: a Trainer runs again and again on the CLI's code path, keeps a history ready
to plot, evaluates, saves, gives logits, describes shardings, and holds its workdir."""

import math
from pathlib import Path

import numpy as np
import pytest

from jaxscale import Trainer
from jaxscale.errors import ConfigError
from jaxscale.runtime.loop import train


def test_a_trainer_continues_where_it_stopped_on_the_clis_code_path(tiny_config, tmp_path):
    tiny_config.train.update(steps=12, log_every=2, eval_every=4)
    with Trainer(tiny_config, tmp_path / "nb") as trainer:
        seen = []  # user hooks: (which, step, the state's step, the logged record's step and evaluation)
        trainer.add_hook(lambda i: seen.append(("2", i.step, int(i.state.step),
                                                (i.record["step"], "val_loss" in i.record))), 2)
        trainer.add_hook(lambda i: seen.append(("3", i.step, int(i.metrics["tokens"] > 0), i.record)), every=3)
        with pytest.raises(ValueError, match="every=0"):
            trainer.add_hook(print, every=0)
        first, second = trainer.run(4), trainer.run(4)
        assert [r["step"] for r in first + second] == [1, 2, 4, 6, 8] and trainer.step == 8
        assert seen == [("2", 2, 2, (2, False)), ("3", 3, 1, None), ("2", 4, 4, (4, True)), ("2", 6, 6, (6, False)),
                        ("3", 6, 1, second[0]), ("2", 8, 8, (8, True))]
        with pytest.raises(ConfigError, match="is in use by another run"):
            Trainer(tiny_config, tmp_path / "nb")
        metrics = trainer.metrics
        assert metrics["step"] == [1, 2, 4, 6, 8] and math.isnan(metrics["val_loss"][0])
        assert metrics["val_loss"][2] == pytest.approx(trainer.evaluate(), rel=0.2)  # same batches, later params
        assert trainer.save() == 8 and (tmp_path / "nb" / "checkpoints" / "8").is_dir()
        logits = trainer.logits(np.arange(10) % 256)
        assert logits.shape == (1, 10, 256) and logits.dtype == np.float32
        table = trainer.sharding_table()
        assert "params/embed" in table and "PartitionSpec" in table and "opt_state/" in table
    cli = train(tiny_config, tmp_path / "cli", show_progress=False, until=8)
    assert [r["loss"] for r in cli] == [r["loss"] for r in first + second]  # bit-identical
    with Trainer(tiny_config, tmp_path / "nb") as again:  # resumes, with the earlier history
        assert again.step == 8 and again.run(2)[0]["step"] == 10
        assert again.metrics["step"] == [1, 2, 4, 6, 8, 10]


def test_from_hf_defaults_its_workdir_and_fits_seq_len_to_a_gpt2s_positions(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                 bos_token_id=0, eos_token_id=0)  # 32 positions: fewer than train.seq_len=128
    transformers.GPT2LMHeadModel(hf).save_pretrained(tmp_path / "tiny-gpt2", safe_serialization=True)
    monkeypatch.chdir(tmp_path)
    with Trainer.from_hf(tmp_path / "tiny-gpt2") as trainer:
        assert trainer.workdir == Path("runs/tiny-gpt2")
        assert (tmp_path / "runs/tiny-gpt2/hf_import/checkpoints/0").is_dir()
        assert trainer.config.train.seq_len == 32 and trainer.config.model.max_seq_len == 32
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ") and "seq_len" in line]
    assert len(notes) == 1 and "train.seq_len=128" in notes[0] and "train.seq_len=32" in notes[0], notes
