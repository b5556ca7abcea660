"""The persistent compilation cache: on by default, a second identical start loads the train step
from it instead of compiling, and one setting turns it off."""

from conftest import run_cli

ARGS = ["--config=configs/tiny.py", "--config.train.steps=2", "--config.train.eval_every=0",
        "--config.model.num_layers=1", "--config.checkpoint.every_steps=0"]


def _start(tmp_path, name, *extra):
    # The suite's own cache (JAX_COMPILATION_CACHE_DIR) is there too: a named directory wins over it.
    done = run_cli([*ARGS, f"--workdir={tmp_path / name}", *extra], devices=1)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_second_start_loads_the_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _start(tmp_path, "a", f"--config.xla.compile_cache_dir={cache}")
    assert f"compiled programs cached in {cache}" in first and "compiled the train step in" in first
    assert any(cache.iterdir())
    second = _start(tmp_path, "b", f"--config.xla.compile_cache_dir={cache}")
    assert "loaded the compiled train step from the cache in" in second


def test_one_setting_turns_it_off(tmp_path):
    out = _start(tmp_path, "c", "--config.xla.compile_cache=False", f"--config.xla.compile_cache_dir={tmp_path / 'x'}")
    assert "compiled programs cached" not in out and not (tmp_path / "x").exists()
