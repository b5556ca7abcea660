"""Data: every source, tokenizers, determinism, the held-out split and global batch assembly."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.config import defaults
from jaxscale.data import load_tokenizer, make_data, process_rows
from jaxscale.data.windows import TokenWindows
from conftest import make_layout
from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh

TEXT = "The quick brown fox jumps over the lazy dog. " * 400  # 18 KB


def _sharding(devices=8):
    return make_layout(data=devices).batch_sharding()


def _config(path="", **data):
    config = defaults()
    config.train.update(global_batch_size=8, seq_len=16, seed=0)
    config.data.update(path=str(path), **data)
    return config


def _assert_windows_follow(batch, stream):
    """Each row's targets are its inputs shifted by one, and the row occurs in the token stream."""
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    text = stream.tobytes()
    for row in np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1):
        assert row.astype(stream.dtype).tobytes() in text


def test_embedded_corpus_is_real_text():
    data = make_data(_config(), _sharding())
    batch = data.local_batch(0)
    assert batch["inputs"].shape == (8, 16) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    text = data.tokenizer.decode(batch["inputs"].reshape(-1))
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
    assert data.num_train_tokens > 400_000 and data.num_val_tokens > 20_000


def test_text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    data = make_data(_config(path), _sharding())
    stream = np.frombuffer(TEXT.encode() + b"\0", np.uint8)
    _assert_windows_follow(data.local_batch(3), stream)
    assert data.num_train_tokens + data.num_val_tokens == len(stream)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_document_files(tmp_path, suffix):
    docs = [f"document {i}: " + TEXT[: 200 + i] for i in range(40)]
    path = tmp_path / f"docs{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"body": docs}), path)
    data = make_data(_config(path, text_field="body"), _sharding())
    stream = np.frombuffer(b"".join(d.encode() + b"\0" for d in docs), np.uint8)
    _assert_windows_follow(data.local_batch(0), stream)


@pytest.mark.parametrize("suffix, dtype", [(".bin", np.uint16), (".npy", np.uint32)])
def test_pretokenized_files(tmp_path, suffix, dtype):
    tokens = (np.arange(5000) * 7 % 1000).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    tokens.tofile(path) if suffix == ".bin" else np.save(path, tokens)
    config = _config(path, token_dtype=np.dtype(dtype).name)
    config.model.vocab_size = 1000
    data = make_data(config, _sharding())
    _assert_windows_follow(data.local_batch(2), tokens)


def test_synthetic_is_learnable_progressions():
    config = _config(source="synthetic")
    batch = make_data(config, _sharding()).local_batch(0)
    steps = (batch["targets"] - batch["inputs"]) % config.model.vocab_size
    assert (steps == steps[:, :1]).all()  # each row advances by a constant stride


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.eos_id == 1 and loaded.decode(loaded.encode("the lazy dog")) == "the lazy dog"
    (tmp_path / "a.txt").write_text(TEXT)
    config = _config(tmp_path / "a.txt", tokenizer=str(tmp_path / "tokenizer.json"))
    config.train.seq_len = 8
    assert make_data(config, _sharding()).local_batch(0)["inputs"].max() < loaded.vocab_size


def test_tiktoken_if_available():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        tiktoken.get_encoding("gpt2")
    except Exception:
        pytest.skip("tiktoken's gpt2 file is not cached and there is no network")
    tok = load_tokenizer("tiktoken:gpt2")
    assert tok.vocab_size == 50257 and tok.decode(tok.encode("hello world")) == "hello world"


def test_order_is_deterministic_and_seeded():
    first = make_data(_config(), _sharding())
    again = make_data(_config(), _sharding())
    other = _config()
    other.train.seed = 1
    reseeded = make_data(other, _sharding())
    np.testing.assert_array_equal(first.local_batch(5)["inputs"], again.local_batch(5)["inputs"])
    assert not np.array_equal(first.local_batch(5)["inputs"], reseeded.local_batch(5)["inputs"])
    assert not np.array_equal(first.local_batch(0)["inputs"], first.local_batch(1)["inputs"])


def test_each_epoch_visits_every_window_once_in_a_new_order(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT[:2000])
    config = _config(path, val_fraction=0.2)
    data = make_data(config, _sharding())
    windows = TokenWindows(np.frombuffer(TEXT[:2000].encode() + b"\0", np.uint8)[: data.num_train_tokens], 16)
    per_epoch = len(windows)  # 100 windows, 8 per batch: epochs do not align with batches
    rows = np.concatenate([data.local_batch(s)["inputs"] for s in range(2 * per_epoch // 8 + 1)])
    epoch0, epoch1 = rows[:per_epoch], rows[per_epoch:2 * per_epoch]
    expected = sorted(windows[i]["inputs"].tobytes() for i in range(per_epoch))
    assert sorted(r.tobytes() for r in epoch0) == expected == sorted(r.tobytes() for r in epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_validation_is_held_out(tmp_path):
    path = tmp_path / "a.txt"
    text = "".join(f"line {i:05d}\n" for i in range(3000))
    path.write_text(text)
    data = make_data(_config(path), _sharding())
    train_rows = {r.tobytes() for s in range(200) for r in data.local_batch(s)["inputs"]}
    val = data.val_batches(2)
    val_rows = {r.tobytes() for b in val for r in np.asarray(b["inputs"]).astype(np.int32)}
    assert not train_rows & val_rows
    again = data.val_batches(2)
    np.testing.assert_array_equal(np.asarray(val[1]["targets"]), np.asarray(again[1]["targets"]))


def test_global_batch_matches_numpy_and_device_count():
    eight = make_data(_config(), _sharding(8))
    one = make_data(_config(), _sharding(1))
    batch8 = next(eight.train_batches(start_step=4))
    batch1 = next(one.train_batches(start_step=4))
    assert batch8["inputs"].sharding.spec == P("data") and len(batch8["inputs"].addressable_shards) == 8
    assert batch8["inputs"].addressable_shards[1].data.shape == (1, 16)
    np.testing.assert_array_equal(np.asarray(batch8["inputs"]), eight.local_batch(4)["inputs"])
    np.testing.assert_array_equal(np.asarray(batch8["targets"]), np.asarray(batch1["targets"]))


def test_process_rows_single_process():
    assert process_rows(_sharding(8), (8, 16)) == slice(0, 8)
    mesh = make_mesh({"data": 8, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1})
    assert process_rows(NamedSharding(mesh, P()), (8, 16)) == slice(0, 8)


@pytest.mark.parametrize("case, field", [
    ("missing_file", "data.path"),
    ("bad_text_field", "data.text_field"),
    ("token_above_vocab", "model.vocab_size"),
    ("tokenizer_above_vocab", "model.vocab_size"),
    ("too_little_data", "train.seq_len"),
    ("missing_tokenizer_file", "data.tokenizer"),
])
def test_bad_data_input_names_field(tmp_path, case, field):
    config = _config()
    if case == "missing_file":
        config.data.path = str(tmp_path / "nope.txt")
    elif case == "bad_text_field":
        (tmp_path / "a.jsonl").write_text(json.dumps({"content": "hi"}) + "\n")
        config.data.path = str(tmp_path / "a.jsonl")
    elif case == "token_above_vocab":
        np.arange(3000, dtype=np.uint16).tofile(tmp_path / "t.bin")
        config.data.path = str(tmp_path / "t.bin")
    elif case == "tokenizer_above_vocab":
        config.model.vocab_size = 100
    elif case == "too_little_data":
        (tmp_path / "a.txt").write_text("tiny")
        config.data.path = str(tmp_path / "a.txt")
    else:
        config.data.tokenizer = str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError) as info:
        make_data(config, _sharding())
    assert info.value.field == field and "\n" not in str(info.value)
