"""Data throughput: `python -m jaxscale.prepare` against the tokenizer's own batch encoding, and
the loader against what a training step consumes.

    python benchmarks/data.py [--mb=200] [--workers=N] [--rounds=3] [--json] [--append] [--smoke]

The corpus: --mb megabytes of JSON lines in 8 files, each document a random run of lines of the
pydoc topic pages (real English and code, shipped with CPython). The tokenizer: a byte-level BPE
of 8,192 tokens trained on those pages with `tokenizers`. The limit is that tokenizer's own
`encode_batch` on one core (RAYON_NUM_THREADS=1, 1 MB batches); prepare runs in a fresh process
with --workers (default: one per core), so its tokens/s per worker against the limit is what
reading, batching, writing and the process pool cost. The byte tokenizer row shows that cost
alone. Peak memory is what prepare reports from the kernel's peak resident sizes.

The loader reads the store as a 0.7/0.3 mixture with a second, smaller store, seq_len 1024 and a
global batch of 64 (one process, 8 fake devices): windows per second from Data.local_batch (the
reading alone) and from Data.train_batches (Grain's read threads and the transfer to devices),
medians over --rounds; against configs/tiny.py's train step on this machine, whose batch and
step time say how many windows a second training consumes.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the limit is one core's; before tokenizers loads
_common.fake_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

FILES = 8
SEQ_LEN, BATCH = 1024, 64


def _pages() -> list[str]:
    from pydoc_data.topics import topics

    return [line for key in sorted(topics) for line in topics[key].splitlines()]


def write_corpus(root: Path, megabytes: float) -> int:
    """FILES JSON-lines files of about `megabytes` MB in all; their bytes."""
    lines, rng = _pages(), np.random.default_rng(0)
    per_file = int(megabytes * 2**20 / FILES)
    for i in range(FILES):
        with open(root / f"corpus-{i}.jsonl", "w") as out:
            written = 0
            while written < per_file:
                start = int(rng.integers(0, len(lines) - 60))
                record = json.dumps({"text": "\n".join(lines[start:start + int(rng.integers(5, 60))])}) + "\n"
                written += out.write(record)
    return sum(p.stat().st_size for p in root.glob("corpus-*.jsonl"))


def train_tokenizer(path: Path, vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_pages(), trainer)
    tokenizer.save(str(path))
    return str(path)


def encode_limit(spec: str, corpus: Path, megabytes: float) -> float:
    """Tokens per second of the tokenizer's own encode_batch on one core, 1 MB batches."""
    from jaxscale.data.tokenize import load_tokenizer

    tokenizer, texts = load_tokenizer(spec), []
    with open(corpus / "corpus-0.jsonl") as lines:
        for line in lines:
            texts.append(json.loads(line)["text"])
            if sum(map(len, texts)) >= megabytes * 2**20:
                break
    batches, batch, size = [], [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= 2**20:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    start = time.perf_counter()
    tokens = sum(len(ids) for b in batches for ids in tokenizer.encode_batch(b))
    return tokens / (time.perf_counter() - start)


def run_prepare(inputs: str, out: Path, spec: str, workers: int) -> dict:
    """prepare in a fresh process: seconds, tokens, tokens/s and peak memory (MiB)."""
    command = [sys.executable, "-m", "jaxscale.prepare", f"--input={inputs}", f"--out={out}", f"--tokenizer={spec}",
               f"--workers={workers}", "--progress=false", "--shard_mb=16"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_common.ROOT, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    peak = re.search(r"<= (\d+) MiB$|peak memory (\d+) MiB$", done.stdout.strip())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "peak_mib": int(next(g for g in peak.groups() if g))}


def loader_rates(mixture: str, tokenizer: str, rounds: int, steps: int) -> dict:
    """Median windows/s of Data.local_batch and of Data.train_batches over `rounds`."""
    import jax

    from jaxscale.build import build
    from jaxscale.data import make_data

    config = _common.tiny_config([f"data.mixture={mixture}", f"data.tokenizer={tokenizer}", "model.vocab_size=8192",
                      f"train.seq_len={SEQ_LEN}", f"train.global_batch_size={BATCH}"])
    data = make_data(config, build(config).batch_sharding)
    direct, threaded = [], []
    for r in range(rounds):
        first = r * 2 * steps
        start = time.perf_counter()
        for step in range(first, first + steps):
            data.local_batch(step)
        direct.append(steps * BATCH / (time.perf_counter() - start))
        batches = data.train_batches(first + steps)
        start = time.perf_counter()
        for _, batch in zip(range(steps), batches):
            jax.block_until_ready(batch)
        threaded.append(steps * BATCH / (time.perf_counter() - start))
    return {"local_batch_windows_per_s": statistics.median(direct),
            "train_batches_windows_per_s": statistics.median(threaded), "shares": data.stats(2 * rounds * steps)}


def step_consumption(overrides: list[str], rounds: int) -> dict:
    """configs/tiny.py's train step here: windows per step and step seconds (median)."""
    import _steps

    config = _common.tiny_config(overrides)
    timed = _steps.stepper(config, steps=5)
    seconds = statistics.median(timed.timed() for _ in range(rounds))
    batch = config.train.global_batch_size
    return {"windows_per_step": batch, "seq_len": config.train.seq_len, "step_s": seconds,
            "windows_per_s": batch / seconds}


def _table(r: dict) -> str:
    rows = ["| tokenizer | limit: encode_batch, 1 core | prepare, tokens/s | per worker | per worker / limit "
            "| wall | peak memory |", "|---|---|---|---|---|---|---|"]
    for name, p in r["prepare"].items():
        limit = r["limit"].get(name)
        per = p["tokens_per_s"] / r["workers"]
        rows.append(f"| {name} | {f'{limit:,.0f}' if limit else '-'} | {p['tokens_per_s']:,.0f} | {per:,.0f} | "
                    f"{f'{per / limit:.2f}' if limit else '-'} | {p['seconds']:.1f} s | {p['peak_mib']} MiB |")
    load, step = r["loader"], r["step"]
    return "\n".join(rows) + (
        f"\n\nLoader (0.7/0.3 mixture of the BPE store and a second store, seq_len {SEQ_LEN}, batch {BATCH}): "
        f"{load['local_batch_windows_per_s']:,.0f} windows/s reading (Data.local_batch), "
        f"{load['train_batches_windows_per_s']:,.0f} windows/s with Grain's threads and the transfer to 8 "
        f"devices (Data.train_batches); realised shares {json.dumps(load['shares'])}. configs/tiny.py's step "
        f"here takes {step['step_s'] * 1e3:.1f} ms for {step['windows_per_step']} windows of "
        f"{step['seq_len']}: {step['windows_per_s']:,.0f} windows/s consumed.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    _common.add_flags(parser)
    args = parser.parse_args(argv)
    megabytes, vocab, steps = (1.0, 400, 2) if args.smoke else (args.mb, 8192, 20)
    step_overrides = ["model.num_layers=1", "train.global_batch_size=8"] if args.smoke else []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = write_corpus(root, megabytes)
        bpe = train_tokenizer(root / "tokenizer.json", vocab)
        inputs = str(root / "corpus-*.jsonl")
        result = {"benchmark": "data", "corpus_bytes": size, "workers": args.workers,
                  "limit": {"bpe": encode_limit(bpe, root, min(megabytes, 16))},
                  "prepare": {"bpe": run_prepare(inputs, root / "bpe", bpe, args.workers),
                              "bytes": run_prepare(inputs, root / "bytes", "bytes", args.workers)}}
        run_prepare(str(root / "corpus-7.jsonl"), root / "small", bpe, 1)
        mixture = f"web={root / 'bpe'}:0.7,small={root / 'small'}:0.3"
        result["loader"] = loader_rates(mixture, bpe, args.rounds, steps)
        result["step"] = step_consumption(step_overrides, args.rounds)
    text = _common.entry(f"Data: prepare {size / 2**20:,.0f} MiB, and the loader", _table(result))
    _common.report(args, text, result)


if __name__ == "__main__":
    main()
