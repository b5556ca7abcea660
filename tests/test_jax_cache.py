"""The persistent compilation cache: on by default, a second identical start loads the train step
and the state's initialisation whole (jaxscale.runtime.program_cache: no tracing either) and trains to
the same losses; without them (after an edit of jaxscale) it loads them from JAX's cache after
lowering, and keeps none of those; one setting turns both off."""

import json
import shutil

import jax

from conftest import run_cli, small_config
from jaxscale.runtime import jax_cache, program_cache

ARGS = ["--config=configs/tiny.py", "--config.train.steps=2", "--config.train.eval_every=0",
        "--config.model.num_layers=1", "--config.checkpoint.every_steps=0"]


def _start(tmp_path, name, *extra):
    # The suite's own cache (JAX_COMPILATION_CACHE_DIR) is there too: a named directory wins over it.
    done = run_cli([*ARGS, f"--workdir={tmp_path / name}", *extra], devices=1)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _losses(workdir) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_start_loads_the_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _start(tmp_path, "a", f"--config.xla.compile_cache_dir={cache}")
    assert f"compiled programs cached in {cache}" in first and "compiled the train step in" in first
    assert any(cache.iterdir())
    assert {p.name.split("-")[0] for p in (cache / "programs").iterdir()} == {"init_state", "train_step"}
    second = _start(tmp_path, "b", f"--config.xla.compile_cache_dir={cache}")
    assert "loaded the whole train step from the cache in" in second
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # bit for bit: the same programs
    shutil.rmtree(cache / "programs")  # as after an edit of jaxscale: the programs miss, JAX's cache does not
    lowered = _start(tmp_path, "d", f"--config.xla.compile_cache_dir={cache}")
    assert "loaded the compiled train step from the cache in" in lowered
    assert not any((cache / "programs").glob("*")), "a program JAX's cache loaded is not kept (it would not run)"


def test_one_setting_turns_it_off(tmp_path, monkeypatch):
    """What a run's session does first (jaxscale.runtime.session): xla.compile_cache=False turns
    JAX's cache off (and with it the program cache), and no directory is made."""
    monkeypatch.setenv(program_cache.ENV, "1")  # as a run sets it when the cache is on
    config = small_config()
    config.xla.update(compile_cache=False, compile_cache_dir=str(tmp_path / "x"))
    was = jax.config.jax_enable_compilation_cache
    try:
        assert jax_cache.enable(config.xla) is None  # no "compiled programs cached" note
        assert not jax.config.jax_enable_compilation_cache and program_cache.directory() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
    assert not (tmp_path / "x").exists()
