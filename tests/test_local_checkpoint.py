"""The local checkpoint layer in one process (8 CPU devices): blocks saved on one mesh come back
on another, and a copy that is incomplete, stale or another workdir's is not used. Several
processes, peer replicas and a lost host: tests/test_elastic.py."""

import json
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.checkpoint import LocalCheckpointer


def _state(devices: int):
    """A small state: a matrix split over rows, a vector over both mesh axes, a replicated scalar."""
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // 2, 2), ("data", "tensor"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return mesh, {"w": put(jnp.arange(48.0).reshape(8, 6), P("data")),
                  "v": put(jnp.arange(8, dtype=jnp.bfloat16), P(("data", "tensor"))),
                  "step": put(jnp.int32(4), P()), "ok": put(jnp.ones(4, bool), P("tensor"))}


def _target(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _local(workdir, mesh, directory):
    return LocalCheckpointer(workdir, types.SimpleNamespace(local_every_steps=2, local_dir=str(directory)), mesh)


@pytest.fixture
def saved(tmp_path):
    """(workdir, local dir, the state saved at step 4 and 6) on an 8-device mesh."""
    workdir, directory = tmp_path / "run", tmp_path / "local"
    workdir.mkdir()
    mesh, state = _state(8)
    local = _local(workdir, mesh, directory)
    for step in (2, 4, 6):
        local.save(step, state, {"global_sample": step * 16})
    local.wait()
    return workdir, directory, state


def test_a_local_copy_comes_back_on_another_mesh(saved):
    workdir, directory, state = saved
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6"]  # the two newest
    mesh, other = _state(4)
    said = []
    restored = _local(workdir, mesh, directory).restore(_target(other), None, said.append)
    step, got, position = restored.step, restored.state, restored.position
    assert (step, position) == (6, {"global_sample": 96}) and "restored step 6" in said[0]
    for name in state:
        assert got[name].sharding == other[name].sharding and got[name].dtype == state[name].dtype
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(state[name]))


def test_the_state_may_be_donated_while_its_copy_is_written(tmp_path, monkeypatch):
    mesh, state = _state(8)
    want = jax.tree.map(np.array, state)
    local = _local(tmp_path, mesh, tmp_path / "local")
    donated, savez = threading.Event(), np.savez
    monkeypatch.setattr(np, "savez", lambda *a, **k: (donated.wait(), savez(*a, **k)))  # write after the step
    local.save(2, state, {"global_sample": 32})
    state = jax.jit(lambda s: jax.tree.map(lambda x: ~x if x.dtype == bool else x + 1, s), donate_argnums=0)(state)
    jax.block_until_ready(state)
    donated.set()
    local.wait()
    got = local.restore(_target(state), None, print).state
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)


def test_no_copy_older_than_the_persistent_checkpoint_or_of_another_workdir(saved, tmp_path):
    workdir, directory, state = saved
    mesh, _ = _state(8)
    assert _local(workdir, mesh, directory).restore(_target(state), 6, print) is None
    fresh = tmp_path / "recreated"
    fresh.mkdir()
    assert _local(fresh, mesh, directory).restore(_target(state), None, print) is None  # another token


@pytest.mark.parametrize("damage, note", [
    ("unfinished", None), ("unreadable", "step 6 does not read on process 0 (BadZipFile"),
    ("a block lost", "step 6: 1 blocks are held by no process that is left (e.g. 0@0:2)")])
def test_an_incomplete_or_unreadable_copy_falls_back_to_the_one_before(saved, damage, note):
    workdir, directory, state = saved
    meta = directory / "6" / "p0of1.json"
    if damage == "unfinished":  # its writer died before the step was complete
        meta.unlink()
    elif damage == "unreadable":
        meta.with_suffix(".npz").write_bytes(b"PK\x03\x04 not a zip")
    else:  # as when the only process holding that block (and its replica) is gone
        held = json.loads(meta.read_text())
        meta.write_text(json.dumps(dict(held, held=held["held"][1:])))
    mesh, _ = _state(8)
    said = []
    restored = _local(workdir, mesh, directory).restore(_target(state), None, said.append)
    step, position = restored.step, restored.position
    assert (step, position["global_sample"]) == (4, 64)
    assert note is None or note in said[0], said
    said = []
    wider = dict(state, w=jnp.zeros((8, 7)))
    assert _local(workdir, mesh, directory).restore(_target(wider), None, said.append) is None
    assert "holds other arrays than this run needs" in said[0]
