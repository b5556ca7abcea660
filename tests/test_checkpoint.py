"""Checkpoints: bit-identical resume on the same mesh, restore onto other meshes and device
counts, rotation and keep-every-N, time-based saves, integrity checks with fallback,
config compatibility, resume_from / init_from, and the workdir lock."""

import collections
import json
import re
import shutil
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import small_config
from jaxscale.build import build
from jaxscale.checkpoint import CORRUPT_DIR, Checkpointer, digest
from jaxscale.errors import ConfigError
from jaxscale.runtime.loop import train
from jaxscale.runtime.workdir import WorkdirLock


def _committed(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _restore(config, workdir, devices=None, **kwargs):
    """(Restored, warnings) of workdir's newest good step, restored onto config's mesh."""
    run = build(config, devices)
    warnings = []
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    try:
        return checkpointer.restore(run.abstract_state, warn=warnings.append, **kwargs), warnings
    finally:
        checkpointer.close()


def _by_step(records):
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A data=8 run of the test config to step 10 (saves at 5 and 10), and the whole 14-step run."""
    config = small_config()
    config.train.update(steps=14, log_every=1)
    config.checkpoint.every_steps = 5
    root = tmp_path_factory.mktemp("saved")
    whole = train(config, root / "whole", show_progress=False)
    train(config, root / "split", show_progress=False, until=10)
    return config, root, whole


def test_resume_is_bit_identical_on_the_same_mesh(saved, tmp_path):
    config, root, whole = saved
    shutil.copytree(root / "split", tmp_path / "split")
    rest = train(config, tmp_path / "split", show_progress=False)
    assert [r["step"] for r in rest] == [11, 12, 13, 14]
    for got in rest:  # exact, not approximate
        assert got["loss"] == _by_step(whole)[got["step"]]["loss"]
        assert got["grad_norm"] == _by_step(whole)[got["step"]]["grad_norm"]
    a, _ = _restore(config, root / "whole")
    b, _ = _restore(config, tmp_path / "split")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.state), jax.device_get(b.state))
    assert a.position["global_sample"] == 14 * config.train.global_batch_size


@pytest.mark.parametrize("layout, devices", [
    (dict(data=1, fsdp=4, tensor=2), 8),
    (dict(data=4, pipeline=2), 8),
    (dict(data=2, sequence=2, tensor=2, zero_stage=3), 8),
    (dict(data=1), 1),
], ids=["fsdp4_tensor2", "data4_pipeline2", "data2_sequence2_tensor2_zero3", "one_device"])
def test_restores_onto_another_mesh_and_continues(saved, tmp_path, layout, devices):
    config, root, whole = saved
    config = config.copy_and_resolve_references()
    zero = layout.pop("zero_stage", 0)
    config.mesh.update(layout)
    config.zero_stage = zero
    subset = jax.devices()[:devices]
    original, _ = _restore(saved[0], root / "split")
    moved, _ = _restore(config, root / "split", devices=subset)
    assert moved.step == 10
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(moved.state.params),
                 jax.device_get(original.state.params))  # bit-equal on the new layout
    shutil.copytree(root / "split", tmp_path / "run")
    rest = train(config, tmp_path / "run", show_progress=False, until=12, devices=subset)
    assert [r["step"] for r in rest] == [11, 12]
    for got in rest:
        np.testing.assert_allclose(got["loss"], _by_step(whole)[got["step"]]["loss"], rtol=1e-5)


def test_first_digests_compile_in_the_background_and_read_a_copy_of_the_saved_arrays():
    """The caller traces nothing, and may donate (here: delete) the arrays once start returns."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    host = {"w": np.arange(96, dtype=np.float32).reshape(8, 12) / 7, "b": np.arange(11, dtype=np.int32)}
    shardings = {"w": NamedSharding(mesh, P(None, "tensor")), "b": NamedSharding(mesh, P())}  # shapes no other test has
    tree = jax.device_put(host, shardings)
    traced = collections.Counter()

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced["caller" if threading.current_thread() is threading.main_thread() else "background"] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        digester, mapping = digest.Digester(), digest.pending(tree)
        digester.start(tree, mapping)
        jax.tree.map(lambda x: x.delete(), tree)
        digester.finish()
        got = dict(mapping.items())
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert traced["caller"] == 0 and traced["background"] >= 1, traced
    assert got == digest.digests(jax.device_put(host, shardings))


def test_rotation_keeps_the_newest_and_every_nth(tiny_config, tmp_path):
    tiny_config.checkpoint.update(every_steps=1, max_to_keep=2, keep_every=2)
    tiny_config.train.update(steps=5, eval_every=0)
    train(tiny_config, tmp_path, show_progress=False)
    assert _committed(tmp_path) == [2, 4, 5]  # the newest 2 and every 2nd; 1 and 3 deleted
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))


def test_time_based_saves(tiny_config, tmp_path):
    tiny_config.checkpoint.update(every_steps=0, every_minutes=0.0005, max_to_keep=100)  # 30 ms
    tiny_config.train.update(steps=40, eval_every=0)
    train(tiny_config, tmp_path, show_progress=False)
    steps = _committed(tmp_path)
    assert steps[-1] == 40 and len(steps) >= 3, steps  # the last step, and saves on the clock before it


def _corrupt(step_dir, mode):
    if mode == "digest":  # the bytes read, but not as saved: one recorded digest no longer matches
        meta = step_dir / "meta" / "metadata"
        record = json.loads(meta.read_text())
        record["digests"]["params/embed"] = "0" * 16
        meta.write_text(json.dumps(record))
        return
    data = max((p for p in (step_dir / "state").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    if mode == "flip":
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
    elif mode == "truncate":
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        data.unlink()


# A flipped bit in a compressed chunk either fails to decode or decodes to other values: both are
# caught (which one depends on where the chunk lands in the file). A digest that disagrees is one way.
@pytest.mark.parametrize("mode, reason", [("flip", "differ from their saved digests|an array does not read"),
                                          ("digest", "1 arrays differ from their saved digests"),
                                          ("truncate", "does not read"), ("delete", "does not read")])
def test_a_damaged_step_is_set_aside_and_the_previous_one_used(saved, tmp_path, mode, reason):
    config, root, _ = saved
    workdir = tmp_path / "run"
    shutil.copytree(root / "split", workdir)
    _corrupt(workdir / "checkpoints" / "10", mode)
    restored, warnings = _restore(config, workdir)
    assert restored.step == 5
    assert len(warnings) == 1 and "checkpoint step 10" in warnings[0] and re.search(reason, warnings[0]), warnings
    assert _committed(workdir) == [5]
    assert [p.name.split("-")[0] for p in (workdir / CORRUPT_DIR).iterdir()] == ["10"]  # kept, not deleted


def test_a_changed_model_shape_is_refused_and_a_changed_mesh_noted(saved, tmp_path):
    config, root, _ = saved
    shutil.copytree(root / "split", tmp_path / "run")
    wider = config.copy_and_resolve_references()
    wider.model.update(d_model=128, num_layers=3)
    with pytest.raises(ConfigError, match=r"model.num_layers=3: .* saved with model.num_layers=2; also model.d_model"):
        train(wider, tmp_path / "run", show_progress=False)
    assert _committed(tmp_path / "run") == [5, 10]  # nothing was touched


def test_resume_from_and_init_from_another_workdir(saved, tmp_path, capsys):
    config, root, whole = saved
    resumed = config.copy_and_resolve_references()
    resumed.checkpoint.resume_from = str(root / "split" / "checkpoints" / "5")
    records = train(resumed, tmp_path / "resumed", show_progress=False, until=6)
    assert records[0]["step"] == 6 and records[0]["loss"] == _by_step(whole)[6]["loss"]
    tuned = config.copy_and_resolve_references()
    tuned.checkpoint.init_from = str(root / "split")
    records = train(tuned, tmp_path / "tuned", show_progress=False, until=1)
    out = capsys.readouterr().out
    assert "initialised parameters from" in out and "/10; fresh optimizer state, step 0" in out
    assert records[0]["step"] == 1 and records[0]["loss"] < whole[0]["loss"] - 0.5  # trained weights, fresh Adam
    none = config.copy_and_resolve_references()
    none.checkpoint.resume_from = "none"
    with pytest.raises(ConfigError, match="already holds steps"):
        train(none, tmp_path / "tuned", show_progress=False)


def test_a_second_run_on_a_workdir_in_use_is_refused(tiny_config, tmp_path):
    from conftest import run_cli

    with WorkdirLock(tmp_path):
        with pytest.raises(ConfigError, match="is in use by another run"):
            train(tiny_config, tmp_path, show_progress=False)
        result = run_cli(["--config=configs/tiny.py", f"--workdir={tmp_path}"], devices=1)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and f"--workdir='{tmp_path}': is in use by another run (pid" \
        in result.stderr, result.stderr
    assert not (tmp_path / "checkpoints").exists()
