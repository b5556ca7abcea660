"""python -m jaxscale.prepare: every input format into a token store equal to its documents, the
same bytes whatever the worker count and after a kill -9, bounded memory, and bad input as one
line with exit code 2. The training side of stores and mixtures is in tests/test_mixture.py."""

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from jaxscale import prepare
from jaxscale.data import store
from jaxscale.data.tokenize import load_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras".split()


def documents(count: int, seed: int) -> list[str]:
    """`count` made-up documents of 5..120 words (and some unicode) from `seed`."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 120))) + (" ünïcode ✓" if i % 7 == 0 else "")
            for i in range(count)]


def write_jsonl(path, docs, opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))


def _zstd(path, mode, encoding):
    import zstandard

    return zstandard.open(path, mode, encoding=encoding)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One input of each format, and the documents each holds, in the order a comma list names them."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    docs = {name: documents(300, seed) for seed, name in enumerate(["a", "b", "c", "d", "hf"])}
    write_jsonl(root / "a.jsonl", docs["a"])
    write_jsonl(root / "b.jsonl.gz", docs["b"], gzip.open)
    write_jsonl(root / "c.jsonl.zst", docs["c"], _zstd)
    pq.write_table(pa.table({"text": docs["d"]}), root / "d.parquet", row_group_size=70)
    datasets.Dataset.from_dict({"text": docs["hf"]}).save_to_disk(root / "hf")
    (root / "e.txt").write_text("A text file is one document.\n" * 60_000)  # 1.7 MB: read in pieces
    (root / "f.md").write_text("# Markdown\n\nis text too.\n")
    docs.update(e=[(root / "e.txt").read_text()], f=[(root / "f.md").read_text()])
    spec = ",".join(str(root / name) for name in ["*.jsonl*", "d.parquet", "e.txt", "f.md", "hf"])
    return spec, [d for key in ["a", "b", "c", "d", "e", "f", "hf"] for d in docs[key]]


def _hashes(directory) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _prepare(*args) -> int:
    return prepare.main([*args, "--progress=false"])


def test_every_format_becomes_its_documents_whatever_the_workers(corpus, tmp_path):
    spec, docs = corpus
    assert _prepare(f"--input={spec}", f"--out={tmp_path / 'one'}", "--workers=1", "--shard_mb=0.01") == 0
    assert _prepare(f"--input={spec}", f"--out={tmp_path / 'two'}", "--workers=2", "--shard_mb=0.01") == 0
    assert _hashes(tmp_path / "one") == _hashes(tmp_path / "two")
    made = store.open_store(tmp_path / "two", "data.path")
    manifest = made.manifest
    assert manifest["tokenizer"] == {"spec": "bytes", "identity": "bytes", "vocab_size": 256, "eos_id": 0}
    assert manifest["dtype"] == "uint16" and manifest["documents"] == len(docs)
    kinds = {s["kind"] for s in manifest["shards"]}
    assert kinds == {"jsonl", "jsonl.gz", "jsonl.zst", "parquet", "text", "arrow"}
    assert sum(s["kind"] == "jsonl" for s in manifest["shards"]) > 1  # one JSON-lines file, several shards
    assert sum(s["kind"] == "parquet" for s in manifest["shards"]) > 1  # row groups split too
    # The shards in order are the documents in order, each followed by EOS, and the index finds each.
    expected = b"".join(d.encode() + b"\0" for d in docs)
    assert np.concatenate(made.shards).astype(np.uint8).tobytes() == expected
    found = []
    for index, shard in enumerate(made.shards):
        bounds = made.documents(index)
        assert bounds[0] == 0 and bounds[-1] == len(shard)
        found += [shard[a:b - 1].astype(np.uint8).tobytes().decode() for a, b in zip(bounds, bounds[1:])]
    assert found == docs


def _bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents(500, 99), trainer)
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """An 8 MB corpus in two JSON-lines files, a BPE tokenizer, and its store prepared without a stop."""
    root = tmp_path_factory.mktemp("big")
    for i in range(2):
        write_jsonl(root / f"web-{i}.jsonl", documents(7_000, 10 + i))
    args = [f"--input={root / 'web-*.jsonl'}", f"--tokenizer={_bpe(root / 'tokenizer.json')}", "--workers=2",
            "--shard_mb=0.5", "--progress=false"]
    done = _run(args + [f"--out={root / 'reference'}"])
    assert done.returncode == 0, done.stderr
    return root, args, done.stdout


def _run(args, **kwargs):
    return subprocess.run([sys.executable, "-m", "jaxscale.prepare", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, **kwargs)


def test_memory_stays_bounded(big):
    """Workers hold one batch of text at a time: the main process and every worker together stay
    far below 1 GiB (measured by the kernel: getrusage's peak resident sizes)."""
    _, _, out = big
    total = re.search(r"peak memory (\d+) MiB \+ 2 workers x <= (\d+) MiB = <= (\d+) MiB", out)
    assert total, out
    main, worker, bound = map(int, total.groups())
    assert bound <= 1024 and worker < 400, out


def test_kill_9_then_the_same_command_gives_the_same_bytes(big, tmp_path):
    root, args, _ = big
    out = tmp_path / "store"
    command = [sys.executable, "-m", "jaxscale.prepare", *args, f"--out={out}"]
    job = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not store.is_done(out, 1) and job.poll() is None:  # two shards written: kill mid-way
            os.sched_yield()
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == -signal.SIGKILL
    manifest = json.loads((out / store.MANIFEST).read_text())
    assert not manifest["complete"] and not all(store.is_done(out, i) for i in range(len(manifest["shards"])))
    again = _run(args + [f"--out={out}"])
    assert again.returncode == 0, again.stderr
    assert "continuing" in again.stdout
    assert _hashes(out) == _hashes(root / "reference")


def _bad(case, tmp_path, corpus_spec):
    """(flags, field named) for one bad input."""
    good = [f"--input={corpus_spec}", f"--out={tmp_path / 'out'}", "--workers=1"]
    if case == "empty_glob":
        return [f"--input={tmp_path / 'nothing-*.jsonl'}", f"--out={tmp_path / 'out'}"], "--input"
    if case == "other_tokenizer_on_resume":
        assert _prepare(*good) == 0
        return good[:2] + [f"--tokenizer={_bpe(tmp_path / 'tok.json')}"], "--out"
    if case == "not_json":
        (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{oops\n')
        return [f"--input={tmp_path / 'x.jsonl'}", f"--out={tmp_path / 'out'}", "--workers=2"], "--input"
    if case == "missing_text_field":
        return good + ["--text_field=body"], "--text_field"
    if case == "a_store_as_input":
        assert _prepare(*good) == 0
        return [f"--input={tmp_path / 'out'}", f"--out={tmp_path / 'again'}"], "--input"
    if case == "out_holds_other_files":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
        return good, "--out"
    return good + {"shard_mb_zero": ["--shard_mb=0"], "unknown_flag": ["--shards=3"],
                   "missing_tokenizer": ["--tokenizer=nope.json"]}[case], \
        {"shard_mb_zero": "--shard_mb", "unknown_flag": "--shards", "missing_tokenizer": "--tokenizer"}[case]


@pytest.mark.parametrize("case", ["empty_glob", "other_tokenizer_on_resume", "not_json", "missing_text_field",
                                  "a_store_as_input", "out_holds_other_files", "shard_mb_zero", "unknown_flag",
                                  "missing_tokenizer"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, corpus):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(20, 0)))
    flags, field = _bad(case, tmp_path, str(tmp_path / "in.jsonl"))
    capsys.readouterr()
    assert _prepare(*flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxscale: error: {field}=") and "\n" not in err, err


def test_tokenizer_identity_is_recorded(tmp_path):
    path = _bpe(tmp_path / "tokenizer.json")
    assert load_tokenizer(path).identity.startswith("tokenizer.json sha256:")
    (tmp_path / "in.txt").write_text("hello world\n")
    assert _prepare("--input=" + str(tmp_path / "in.txt"), f"--out={tmp_path / 's'}", f"--tokenizer={path}") == 0
    made = json.loads((tmp_path / "s" / store.MANIFEST).read_text())["tokenizer"]
    assert made["identity"] == load_tokenizer(path).identity and made["spec"] == str(tmp_path / "tokenizer.json")
