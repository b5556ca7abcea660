"""Data: every source, tokenizers, determinism, the held-out split, global batch assembly, errors.

Run alone with: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/test_data.py
"""

import json
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.config import defaults
from jaxscale.data import load_tokenizer, make_data, process_rows
from jaxscale.data.batches import StepBatches
from jaxscale.data.settings import read_settings
from jaxscale.errors import ConfigError

TEXT = "The quick brown fox jumps over the lazy dog. " * 400  # 18 KB
LINES = "".join(f"line {i:05d}\n" for i in range(3000))  # every 16-token window is unique
B, L = 8, 16


def _config(path="", *, seed=0, batch=B, seq_len=L, vocab=256, **data):
    """The default run config with the data, batch and vocabulary fields given here."""
    config = defaults()
    config.data.update(path=str(path), **data)
    config.train.update(seq_len=seq_len, global_batch_size=batch, seed=seed)
    config.model.vocab_size = vocab
    return config


def _sharding(devices=8):
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])
    return NamedSharding(mesh, P("data", None))


def _windows(stream, seq_len=L):
    """Every packed window of `stream` (seq_len+1 tokens, stride seq_len) as int32 bytes, in order."""
    count = (len(stream) - 1) // seq_len
    return [np.asarray(stream[i * seq_len:i * seq_len + seq_len + 1], np.int32).tobytes() for i in range(count)]


def _rows(batch):
    """Each row's whole window (inputs + last target), after checking targets are inputs shifted by one."""
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    assert inputs.dtype == targets.dtype == np.int32 and inputs.shape == targets.shape
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    return [np.concatenate([x, y[-1:]]).tobytes() for x, y in zip(inputs, targets)]


def _assert_train_windows(data, stream, steps=(0, 3)):
    """The batches hold exactly the training windows of `stream`, split where the data says."""
    assert data.num_train_tokens + data.num_val_tokens == len(stream)
    expected = set(_windows(stream[:data.num_train_tokens]))
    for step in steps:
        assert set(_rows(data.local_batch(step))) <= expected


def _bytes_stream(documents):
    return np.frombuffer(b"".join(d.encode() + b"\0" for d in documents), np.uint8)


def test_embedded_corpus_is_pydoc_topics():
    from pydoc_data.topics import topics

    data = make_data(_config(), _sharding())
    _assert_train_windows(data, _bytes_stream(topics[k] for k in sorted(topics)))
    text = data.tokenizer.decode(data.local_batch(0)["inputs"].reshape(-1))
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
    assert data.num_train_tokens > 400_000 and data.num_val_tokens > 20_000


def test_synthetic_is_learnable_and_seeded():
    config = _config(source="synthetic", vocab=97)
    data = make_data(config, _sharding())
    batch = data.local_batch(0)
    steps = (batch["targets"] - batch["inputs"]) % 97
    assert (steps == steps[:, :1]).all() and (steps > 0).all()  # each row: one constant stride
    assert len(set(_rows(batch))) == B
    val = set(_rows(data.val_batches(1)[0]))
    assert val != set(_rows(batch)) and data.num_train_tokens == 2**20 * L
    again = make_data(config, _sharding())
    np.testing.assert_array_equal(again.local_batch(7)["inputs"], data.local_batch(7)["inputs"])


@pytest.mark.parametrize("suffix", [".txt", ".md", ".log"])
def test_text_files(tmp_path, suffix):
    path = tmp_path / f"a{suffix}"
    path.write_text(TEXT)
    _assert_train_windows(make_data(_config(path), _sharding()), _bytes_stream([TEXT]))


def test_text_is_decoded_leniently(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(TEXT.encode() + b"\xff\xfe bad bytes")
    stream = _bytes_stream([(TEXT.encode() + b"\xff\xfe bad bytes").decode(errors="replace")])
    _assert_train_windows(make_data(_config(path), _sharding()), stream)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_document_files(tmp_path, suffix):
    docs = [f"document {i}: " + TEXT[: 200 + i] for i in range(40)]
    path = tmp_path / f"docs{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": list(range(40)), "body": docs}), path)
    else:
        path.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    _assert_train_windows(make_data(_config(path, text_field="body"), _sharding()), _bytes_stream(docs))


@pytest.mark.parametrize("suffix, dtype, vocab", [(".bin", np.uint16, 1000), (".npy", np.uint32, 70_000)])
def test_pretokenized_files(tmp_path, suffix, dtype, vocab):
    tokens = (np.arange(5000) * 7919 % vocab).astype(dtype)  # uint32 case has ids above 65535
    path = tmp_path / f"tokens{suffix}"
    tokens.tofile(path) if suffix == ".bin" else np.save(path, tokens)
    data = make_data(_config(path, token_dtype=np.dtype(dtype).name, vocab=vocab), _sharding())
    _assert_train_windows(data, tokens, steps=(0, 2, 30))
    assert data.tokenizer.decode([300, 65]).endswith("A")  # bytes tokenizer tolerates ids >= 256


def _train_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT, LINES], trainer)
    tokenizer.save(str(path))


def test_hf_tokenizer_json(tmp_path):
    _train_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eos_id == 1 and tok.vocab_size <= 300
    for text in ("the lazy dog", "Ünïcode — and\nnew lines 123"):
        assert tok.decode(tok.encode(text)) == text
    (tmp_path / "a.txt").write_text(TEXT)
    config = _config(tmp_path / "a.txt", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=8, vocab=300)
    data = make_data(config, _sharding())
    stream = np.array(tok.encode(TEXT) + [tok.eos_id])
    assert data.num_train_tokens + data.num_val_tokens == len(stream) < len(TEXT)
    assert set(_rows(data.local_batch(0))) <= set(_windows(stream[:data.num_train_tokens], 8))


def test_a_tiktoken_encoding_tokenizes_and_a_bad_name_is_one_line(monkeypatch, tmp_path):
    """`data.tokenizer=tiktoken:NAME` through tiktoken itself, on an encoding built here (bytes
    and two merges, an end-of-text token: no BPE file to download), into a training store; an
    encoding tiktoken cannot load is a ConfigError naming the field."""
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)} | {b"th": 256, b"the": 257}
    tiny = tiktoken.Encoding("tiny", pat_str=r"\s?\w+|\s+|[^\w\s]+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 258})
    real = tiktoken.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny if name == "tiny" else real(name))
    tok = load_tokenizer("tiktoken:tiny")
    assert (tok.vocab_size, tok.eos_id) == (259, 258) and tok.encode("the") == [257]
    assert tok.decode(tok.encode("the lazy dog <|endoftext|>")) == "the lazy dog <|endoftext|>"
    assert 258 not in tok.encode("<|endoftext|>")  # text spelling the token is data
    (tmp_path / "a.txt").write_text(TEXT)
    data = make_data(_config(tmp_path / "a.txt", tokenizer="tiktoken:tiny", seq_len=8, vocab=259), _sharding())
    stream = np.array(tok.encode(TEXT) + [tok.eos_id])
    assert data.num_train_tokens + data.num_val_tokens == len(stream) < len(TEXT)
    with pytest.raises(ConfigError, match="could not load the encoding") as info:
        load_tokenizer("tiktoken:no_such_encoding")
    assert info.value.field == "data.tokenizer"


def test_order_is_deterministic_and_seeded():
    first, again = make_data(_config(), _sharding()), make_data(_config(), _sharding())
    reseeded = make_data(_config(seed=1), _sharding())
    np.testing.assert_array_equal(first.local_batch(5)["inputs"], again.local_batch(5)["inputs"])
    assert not np.array_equal(first.local_batch(5)["inputs"], reseeded.local_batch(5)["inputs"])
    assert not np.array_equal(first.local_batch(0)["inputs"], first.local_batch(1)["inputs"])


def test_sample_order_does_not_depend_on_batch_size():
    eight, four = make_data(_config(batch=8), _sharding()), make_data(_config(batch=4), _sharding(4))
    halves = [four.local_batch(s)["inputs"] for s in (6, 7)]
    np.testing.assert_array_equal(eight.local_batch(3)["inputs"], np.concatenate(halves))


def test_each_epoch_visits_every_window_once_in_a_new_order(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(LINES[:2000])
    data = make_data(_config(path, val_fraction=0.2), _sharding())
    windows = _windows(_bytes_stream([LINES[:2000]])[:data.num_train_tokens])
    assert len(windows) == 100  # 8 per batch: epochs do not align with batches
    rows = [r for s in range(2 * 100 // B + 1) for r in _rows(data.local_batch(s))]
    epoch0, epoch1 = rows[:100], rows[100:200]
    assert sorted(epoch0) == sorted(windows) == sorted(epoch1)
    assert epoch0 != epoch1 and epoch0 != windows


def test_validation_is_the_held_out_tail(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(LINES)
    data = make_data(_config(path, val_fraction=0.05), _sharding())
    stream = _bytes_stream([LINES])
    assert data.num_val_tokens == int(len(stream) * 0.05)
    val_windows = _windows(stream[data.num_train_tokens:])  # 112 windows: 14 batches, then wraps
    train_rows = {r for s in range(300) for r in _rows(data.local_batch(s))}
    val = data.val_batches(16)
    val_rows = [r for batch in val for r in _rows(batch)]
    assert val_rows == [val_windows[i % len(val_windows)] for i in range(16 * B)]
    assert not train_rows & set(val_rows)
    assert [_rows(b) for b in data.val_batches(2)] == [_rows(b) for b in val[:2]]


def test_global_batch_matches_numpy_and_device_count():
    eight, one = make_data(_config(), _sharding(8)), make_data(_config(), _sharding(1))
    batches8, batches1 = eight.train_batches(start_step=4), one.train_batches(start_step=4)
    batch8, batch1 = next(batches8), next(batches1)
    assert batch8["inputs"].shape == (B, L) and batch8["inputs"].dtype == np.int32
    assert batch8["inputs"].sharding == _sharding(8) and len(batch8["inputs"].addressable_shards) == 8
    assert all(shard.data.shape == (1, L) for shard in batch8["inputs"].addressable_shards)
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(np.asarray(batch8[key]), eight.local_batch(4)[key])
        np.testing.assert_array_equal(np.asarray(batch8[key]), np.asarray(batch1[key]))
    np.testing.assert_array_equal(np.asarray(next(batches8)["inputs"]), eight.local_batch(5)["inputs"])
    val = eight.val_batches(1)[0]
    assert val["inputs"].sharding == _sharding(8)
    np.testing.assert_array_equal(np.asarray(val["targets"]), np.asarray(one.val_batches(1)[0]["targets"]))


def test_no_read_threads_gives_the_same_batches():
    threaded, inline = make_data(_config(), _sharding()), make_data(_config(num_threads=0), _sharding())
    for a, b in zip(threaded.train_batches(2), [next(inline.train_batches(2))]):
        np.testing.assert_array_equal(np.asarray(a["inputs"]), np.asarray(b["inputs"]))


def test_process_rows():
    assert process_rows(_sharding(8), (B, L)) == slice(0, B)
    assert process_rows(_sharding(1), (B, L)) == slice(0, B)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    assert process_rows(NamedSharding(mesh, P()), (B, L)) == slice(0, B)  # replicated


def test_process_rows_rejects_scattered_rows():
    class Scattered:  # what a process would see if its devices held rows 0:2 and 4:6
        def addressable_devices_indices_map(self, shape):
            return {0: (slice(0, 2), slice(None)), 1: (slice(4, 6), slice(None))}

    with pytest.raises(AssertionError, match="not one contiguous range"):
        process_rows(Scattered(), (B, L))


def test_a_process_reads_only_its_rows():
    samples = [{"inputs": np.full(2, i)} for i in range(40)]  # global sample g holds g
    batches = StepBatches(samples, global_batch=8, rows=slice(2, 5))
    assert batches[3]["inputs"][:, 0].tolist() == [26, 27, 28]  # rows 2..4 of step 3 = samples 24+2..24+4


def test_settings_come_from_the_config_defaults():
    config = defaults()
    settings = read_settings(config)
    assert settings.source == "embedded"  # auto, without a path
    for key in ("path", "tokenizer", "text_field", "token_dtype", "val_fraction", "num_threads"):
        assert getattr(settings, key) == config.data[key], key


def test_one_megabyte_text_loads_fast(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text((TEXT * 60)[:1_000_000])
    start = time.perf_counter()
    data = make_data(_config(path), _sharding())
    assert time.perf_counter() - start < 2.0 and data.num_train_tokens > 900_000


def _bad_input(case, tmp_path, monkeypatch):
    """Apply one bad-input case to a fresh config and return it."""
    config = _config()
    write = {"bad_text_field": ("a.jsonl", json.dumps({"content": "hi"}) + "\n"),
             "not_json": ("a.jsonl", '{"text": "a"}\n{oops\n'),
             "json_not_object": ("a.jsonl", '["text"]\n'),
             "too_little_data": ("a.txt", "tiny"),
             "too_little_validation": ("a.txt", TEXT[:300])}
    if case in write:
        name, content = write[case]
        (tmp_path / name).write_text(content)
        config.data.path = str(tmp_path / name)
    elif case in ("token_above_vocab", "odd_bin_size", "negative_npy"):
        path = tmp_path / ("t.npy" if case == "negative_npy" else "t.bin")
        tokens = {"token_above_vocab": np.arange(3000, dtype=np.uint16),
                  "odd_bin_size": np.arange(3001, dtype=np.uint8), "negative_npy": np.arange(-5, 3000)}[case]
        np.save(path, tokens) if case == "negative_npy" else tokens.tofile(path)
        config.data.path = str(path)
    elif case == "unknown_binary_extension":
        (tmp_path / "a.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(100))
        config.data.path = str(tmp_path / "a.gz")
    elif case == "no_tokenizers_package":
        monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
        config.data.tokenizer = str(tmp_path / "tokenizer.json")
    else:
        settings = {"missing_file": ("data.path", str(tmp_path / "nope.txt")),
                    "tokenizer_above_vocab": ("model.vocab_size", 100),
                    "missing_tokenizer_file": ("data.tokenizer", str(tmp_path / "tokenizer.json")),
                    "unknown_source": ("data.source", "hdfs"), "file_without_path": ("data.source", "file"),
                    "bad_token_dtype": ("data.token_dtype", "int8"), "seed_out_of_range": ("train.seed", -1),
                    "val_fraction_zero": ("data.val_fraction", 0.0)}
        field, value = settings[case]
        section, key = field.split(".")
        config[section][key] = value
    return config


@pytest.mark.parametrize("case, field", [
    ("missing_file", "data.path"),
    ("unknown_binary_extension", "data.path"),
    ("not_json", "data.path"),
    ("json_not_object", "data.path"),
    ("negative_npy", "data.path"),
    ("file_without_path", "data.path"),
    ("bad_text_field", "data.text_field"),
    ("unknown_source", "data.source"),
    ("bad_token_dtype", "data.token_dtype"),
    ("odd_bin_size", "data.token_dtype"),
    ("token_above_vocab", "model.vocab_size"),
    ("tokenizer_above_vocab", "model.vocab_size"),
    ("too_little_data", "train.seq_len"),
    ("too_little_validation", "data.val_fraction"),
    ("val_fraction_zero", "data.val_fraction"),
    ("seed_out_of_range", "train.seed"),
    ("missing_tokenizer_file", "data.tokenizer"),
    ("no_tokenizers_package", "data.tokenizer"),
])
def test_bad_data_input_names_field(tmp_path, monkeypatch, case, field):
    config = _bad_input(case, tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as info:
        make_data(config, _sharding())
    message = str(info.value)
    assert info.value.field == field and message.startswith(field + "=") and "\n" not in message
    if case == "no_tokenizers_package":
        assert "pip install 'jaxscale[tokenizers]'" in message
