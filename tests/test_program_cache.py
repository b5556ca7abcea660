"""Whole programs kept between starts (jaxscale.runtime.program_cache): a kept program is loaded without
tracing and computes what the compiled one did; anything a program is built from changes its
key; an unreadable entry is compiled again; the newest KEEP are kept; it is off unless turned on."""

import os
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import small_config
from jaxscale.runtime import program_cache

DEVICES = jax.devices()[:1]


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The cache on, in tmp_path."""
    monkeypatch.setattr(program_cache, "directory", lambda: tmp_path)
    return tmp_path


def _program(traces: list):
    """A program over a mesh of devices 3, 1, 2, 0 (not the first, not in order), new to JAX's
    cache (its constant is): only a program compiled here is kept."""
    salt = float(uuid.uuid4().int % 10**6)

    def f(x, y):
        traces.append(1)
        return jnp.tanh(x @ y).sum() + salt, x * 2

    mesh = Mesh(np.array(jax.devices())[[3, 1, 2, 0]].reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("a", "b")))
    return jax.jit(f, out_shardings=(None, NamedSharding(mesh, P("b", "a")))), (x, jnp.ones((4, 4)))


def test_a_kept_program_is_loaded_without_tracing_and_computes_the_same(kept):
    traces = []
    f, args = _program(traces)
    key = program_cache.key("f", small_config(), DEVICES, *args)
    first, loaded = program_cache.load_or_compile(key, lambda: f.lower(*args))
    assert not loaded and len(traces) == 1 and (kept / f"{key}.pkl").exists()
    hits = program_cache.hits()
    again, loaded = program_cache.load_or_compile(key, lambda: f.lower(*args))
    assert loaded and len(traces) == 1 and program_cache.hits() == hits + 1
    for a, b in zip(jax.tree.leaves(first(*args)), jax.tree.leaves(again(*args)), strict=True):
        assert jnp.array_equal(a, b) and a.sharding == b.sharding


def test_an_unreadable_entry_is_compiled_again(kept):
    f, args = _program([])
    key = program_cache.key("f", small_config(), DEVICES, *args)
    (kept / f"{key}.pkl").write_bytes(b"cut short")
    compiled, loaded = program_cache.load_or_compile(key, lambda: f.lower(*args))
    assert not loaded and float(compiled(*args)[0]) == float(f(*args)[0])
    assert program_cache.load_or_compile(key, lambda: f.lower(*args))[1]  # rewritten whole


def test_a_cache_that_cannot_be_written_costs_nothing_but_the_entry(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be: every write fails
    monkeypatch.setattr(program_cache, "directory", lambda: blocked / "programs")
    f, args = _program([])
    compiled, loaded = program_cache.load_or_compile("f-x", lambda: f.lower(*args))
    assert not loaded and float(compiled(*args)[0]) == float(f(*args)[0])


def test_only_the_newest_are_kept(kept, monkeypatch):
    monkeypatch.setattr(program_cache, "KEEP", 2)
    f, args = _program([])
    for n in range(3):
        program_cache.load_or_compile(f"f-{n}", lambda: f.lower(*args))
        os.utime(kept / f"f-{n}.pkl", (n + 1, n + 1))  # used in this order, long ago
    program_cache.load_or_compile("f-1", lambda: f.lower(*args))  # a use: the newest now
    program_cache.load_or_compile("f-3", lambda: f.lower(*args))
    assert sorted(p.name for p in kept.glob("*.pkl")) == ["f-1.pkl", "f-3.pkl"]


def test_what_a_program_is_built_from_changes_its_key(kept, tmp_path, monkeypatch):
    config, args = small_config(), (jax.ShapeDtypeStruct((4, 4), jnp.float32),)
    base = program_cache.key("f", config, DEVICES, *args)
    assert base == program_cache.key("f", small_config(), DEVICES, *args)
    changed = small_config()
    changed.model.num_layers += 1
    assert program_cache.key("f", changed, DEVICES, *args) != base
    assert program_cache.key("g", config, DEVICES, *args) != base
    assert program_cache.key("f", config, jax.devices()[1:2], *args) != base
    assert program_cache.key("f", config, DEVICES, jax.ShapeDtypeStruct((4, 8), jnp.float32)) != base
    with jax.default_matmul_precision("highest"):
        assert program_cache.key("f", config, DEVICES, *args) != base
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert program_cache.key("f", config, DEVICES, *args) != base
    monkeypatch.undo()
    monkeypatch.setattr(program_cache, "directory", lambda: tmp_path)
    source = tmp_path / "source"
    (source / "models").mkdir(parents=True)
    (source / "models" / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(program_cache, "_SOURCE", source)
    edited = program_cache.key("f", config, DEVICES, *args)
    (source / "models" / "m.py").write_text("x = 2\n")  # an edit on disk misses at the next start
    assert edited != base and program_cache.key("f", config, DEVICES, *args) != edited


def test_off_unless_turned_on(monkeypatch):
    monkeypatch.delenv(program_cache.ENV, raising=False)
    assert program_cache.directory() is None and program_cache.key("f", small_config(), DEVICES) is None
    monkeypatch.setenv(program_cache.ENV, "1")  # the suite's JAX cache directory is set (conftest)
    was = jax.config.jax_enable_compilation_cache  # another test's run may have turned it off (xla.compile_cache)
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        assert program_cache.directory() == Path(jax.config.jax_compilation_cache_dir) / "programs"
        jax.config.update("jax_enable_compilation_cache", False)  # xla.compile_cache=False
        assert program_cache.directory() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
