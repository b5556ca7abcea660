"""Checkpoints: resume is bit-identical on the same mesh and correct on another; old steps rotate."""

import jax
import numpy as np

from jaxscale.checkpoint import Checkpointer
from jaxscale.loop import setup, train


def _params(run_config, workdir):
    run = setup(run_config)
    state, position = Checkpointer(workdir / "checkpoints", run_config.checkpoint).restore(run.shardings, run.state)
    return jax.device_get(state.params), position


def test_resume_is_bit_identical_on_the_same_mesh(tiny_config, tmp_path):
    whole = train(tiny_config, tmp_path / "whole", show_progress=False)
    first = train(tiny_config, tmp_path / "split", show_progress=False, until=10)
    rest = train(tiny_config, tmp_path / "split", show_progress=False)
    assert [r["step"] for r in first] == [1, 5, 10] and [r["step"] for r in rest] == [15, 20]
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]  # exact, not approximate
    assert rest[-1]["val_loss"] == whole[-1]["val_loss"]
    a, position = _params(tiny_config, tmp_path / "whole")
    b, _ = _params(tiny_config, tmp_path / "split")
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert position == {"global_sample": 20 * tiny_config.train.global_batch_size}


def test_resume_on_another_mesh(tiny_config, tmp_path):
    whole = train(tiny_config, tmp_path / "whole", show_progress=False)
    train(tiny_config, tmp_path / "moved", show_progress=False, until=10)  # data=8
    tiny_config.mesh.update(data=2, fsdp=2, tensor=2)
    tiny_config.zero_stage = 3
    rest = train(tiny_config, tmp_path / "moved", show_progress=False)
    assert [r["step"] for r in rest] == [15, 20]
    for got, want in zip(rest, whole[-2:]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def test_periodic_saves_keep_the_newest(tiny_config, tmp_path):
    tiny_config.checkpoint.update(every_steps=5, max_to_keep=2)
    train(tiny_config, tmp_path, show_progress=False)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [15, 20]
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))
