"""The notebook API: a Trainer runs again and again on the CLI's code path, keeps a history ready
to plot, evaluates, saves, gives logits, describes shardings, and holds its workdir."""

import math

import numpy as np
import pytest

from jaxscale import Trainer
from jaxscale.errors import ConfigError
from jaxscale.loop import train


def test_a_trainer_continues_where_it_stopped_on_the_clis_code_path(tiny_config, tmp_path):
    tiny_config.train.update(steps=12, log_every=2, eval_every=4)
    with Trainer(tiny_config, tmp_path / "nb") as trainer:
        first, second = trainer.run(4), trainer.run(4)
        assert [r["step"] for r in first + second] == [1, 2, 4, 6, 8] and trainer.step == 8
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
