"""Stores, lists and mixtures as training data: data.path in every form, data.mixture's shares
and order, exact resume on another number of processes, and bad input before anything compiles."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import ROOT, cli_env, run_cli
from jaxscale import prepare
from jaxscale.config import defaults
from jaxscale.data import make_data
from jaxscale.data.store import MANIFEST
from jaxscale.errors import ConfigError

B, L = 16, 16
WEB, CODE = 69_999, 9_000  # token counts of the two sources: ids 0..99 are web, 100..199 code


def _config(*, seed=0, batch=B, **data):
    config = defaults()
    config.data.update(**data)
    config.train.update(seq_len=L, global_batch_size=batch, seed=seed)
    return config


def _sharding(devices=8):
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])
    return NamedSharding(mesh, P("data", None))


def _prepare(inputs, out, *flags):
    assert prepare.main([f"--input={inputs}", f"--out={out}", "--progress=false", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sources told apart by their ids: a multi-shard store of web text (bytes < 100, from
    three files) and a .bin file of code ids (100..199)."""
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    for i in range(3):
        text = "".join(chr(32 + c) for c in rng.integers(1, 60, WEB // 3 - 1))  # ids 33..91, then EOS 0
        (root / f"web-{i}.txt").write_text(text)
    _prepare(root / "web-*.txt", root / "web", "--workers=1")
    rng.integers(100, 200, CODE).astype(np.uint16).tofile(root / "code.bin")
    return root


def _rows(data, steps):
    return np.concatenate([data.local_batch(step)["inputs"] for step in steps])


def test_a_store_reads_like_its_text_files(sources):
    """A multi-shard store, its files listed, their directory... same windows, same order."""
    store = make_data(_config(path=str(sources / "web")), _sharding())
    assert len(store.splits[0].train.pieces) == 3  # a shard per file (the last one cut for validation)
    for form in (",".join(str(sources / f"web-{i}.txt") for i in range(3)), str(sources / "web-*.txt")):
        files = make_data(_config(path=form), _sharding())
        np.testing.assert_array_equal(_rows(files, range(4)), _rows(store, range(4)))
    assert any("prepare" in note for note in files.notes) and not store.notes
    assert store.num_train_tokens + store.num_val_tokens == WEB


def test_mixture_shares_order_and_epochs(sources):
    mixture = f"web={sources / 'web'}:0.7,code={sources / 'code.bin'}:0.3"
    data = make_data(_config(mixture=mixture, batch=80), _sharding())
    rows = _rows(data, range(125))  # 10,000 windows
    is_code = rows[:, 0] >= 100
    assert abs(is_code.mean() - 0.3) < 0.01 and data.stats(125)["mix_code"] == is_code.mean()
    np.testing.assert_array_equal(rows, _rows(make_data(_config(mixture=mixture, batch=80), _sharding()),
                                              range(125)))  # same seed, same order
    other = _rows(make_data(_config(mixture=mixture, batch=80, seed=1), _sharding()), range(125))
    assert (other != rows).any(axis=1).mean() > 0.9
    # Each source runs through its own epochs: code's first len(code) windows are all of them, once.
    code_windows = len(data.splits[1].train)
    first_epoch = rows[is_code][:code_windows]
    assert len({row.tobytes() for row in first_epoch}) == code_windows == (CODE - int(CODE * 0.05) - 1) // L
    stats = data.stats(125)
    assert stats["epochs_code"] == is_code.sum() / code_windows and stats["epochs_web"] == (~is_code).sum() / len(
        data.splits[0].train)


def test_two_processes_resume_window_by_window(sources, tmp_path):
    """Steps 3..6 read by 2 processes (as a run begun on 1 resumes at step 3) are the windows the
    one-process run reads, row by row: a mixture over a multi-shard store and a token file."""
    overrides = [f"data.mixture=web={sources / 'web'}:0.7,code={sources / 'code.bin'}:0.3",
                 f"train.global_batch_size={B}", f"train.seq_len={L}"]
    one = make_data(_config(mixture=overrides[0].split("=", 1)[1]), _sharding())
    command = [sys.executable, "-m", "jaxscale.launch", "--nproc=2", "--devices_per_proc=4", "--",
               sys.executable, "tests/read_windows.py", str(tmp_path), "3", "7", *overrides]
    done = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    read = {**np.load(tmp_path / "0.npz"), **np.load(tmp_path / "1.npz")}
    assert len(read) == 4 * B
    for step in range(3, 7):
        expected = one.local_batch(step)["inputs"]
        np.testing.assert_array_equal(np.stack([read[f"{step}/{row}"] for row in range(B)]), expected)


def _bad(case, sources, tmp_path):
    """(data.* settings, field named) for one bad input."""
    web, code = sources / "web", sources / "code.bin"
    if case == "other_tokenizer":
        from test_store import _bpe

        return {"path": str(web), "tokenizer": _bpe(tmp_path / "tok.json")}, "data.tokenizer"
    if case in ("truncated_shard", "unfinished_store", "shard_gone"):
        copy = tmp_path / "web"
        _prepare(sources / "web-*.txt", copy, "--workers=1")
        shard = copy / "shard-00001.bin"
        if case == "truncated_shard":
            shard.write_bytes(shard.read_bytes()[:-2])
        elif case == "shard_gone":
            shard.unlink()
        else:
            manifest = json.loads((copy / MANIFEST).read_text())
            (copy / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))
        return {"path": str(copy)}, "data.path"
    return {"empty_glob": ({"path": str(sources / "nothing-*.txt")}, "data.path"),
            "empty_glob_in_mixture": ({"mixture": f"a={web}:1,b={sources / 'x*'}:1"}, "data.mixture"),
            "zero_weight": ({"mixture": f"a={web}:0.7,b={code}:0"}, "data.mixture"),
            "negative_weight": ({"mixture": f"a={web}:0.7,b={code}:-1"}, "data.mixture"),
            "weight_not_a_number": ({"mixture": f"a={web}:lots"}, "data.mixture"),
            "no_weight": ({"mixture": f"a={web}"}, "data.mixture"),
            "name_twice": ({"mixture": f"a={web}:1,a={code}:1"}, "data.mixture"),
            "path_and_mixture": ({"path": str(web), "mixture": f"a={web}:1"}, "data.mixture"),
            "datasetdict": (None, "data.path")}[case]


@pytest.mark.parametrize("case", ["other_tokenizer", "truncated_shard", "unfinished_store", "shard_gone",
                                  "empty_glob", "empty_glob_in_mixture", "zero_weight", "negative_weight",
                                  "weight_not_a_number", "no_weight", "name_twice", "path_and_mixture",
                                  "datasetdict"])
def test_bad_data_names_the_field(case, sources, tmp_path):
    settings, field = _bad(case, sources, tmp_path)
    if settings is None:  # a DatasetDict saved whole: name a split
        (tmp_path / "dd" / "train").mkdir(parents=True)
        (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
        (tmp_path / "dd" / "train" / "state.json").write_text('{"_data_files": []}')
        settings = {"path": str(tmp_path / "dd")}
    with pytest.raises(ConfigError) as info:
        make_data(_config(**settings), _sharding())
    message = str(info.value)
    assert info.value.field == field and message.startswith(field + "=") and "\n" not in message


def test_the_cli_stops_before_compiling(sources, tmp_path):
    mixture = f"data.mixture=web={sources / 'web'}:0.7,code={sources / 'nothing-*.bin'}:0.3"
    done = run_cli(["--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", f"--config.{mixture}"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().startswith("jaxscale: error: data.mixture=") and "\n" not in done.stderr.strip()
    assert "compiled" not in done.stdout
