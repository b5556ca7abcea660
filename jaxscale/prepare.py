"""python -m jaxscale.prepare: tokenize a corpus once into a token store, in parallel.

    python -m jaxscale.prepare --input='corpus/*.parquet' --out=STORE [--tokenizer=bytes]
        [--text_field=text] [--workers=N] [--shard_mb=64] [--progress=true]
        [--chat_template=TEMPLATE] [--train_on=assistant]

Reads .txt/.md, .jsonl/.json (+ .gz/.zst), .parquet and Hugging Face datasets saved with
`save_to_disk` (comma-separate several files, directories or globs), streaming; writes one shard
of token ids and a document index per unit of about shard_mb input megabytes, and a manifest with
the tokenizer's identity (jaxscale.data.store). Train on it with --config.data.path=STORE.
Chat records (jaxscale.data.chat: messages, or prompt and completion) are rendered by the chat
template (--chat_template, as data.chat_template: the tokenizer's own by default) and stored with
their loss mask (--train_on, as data.train_on), one shard per file.

Killed, it continues where it stopped when run again with the same flags, and the store comes out
byte-identical to one prepared without a stop. Bad input exits 2 with one line; nothing is lost.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from pathlib import Path

from jaxscale import cli
from jaxscale.data import build_store, store
from jaxscale.data.tokenize import load_tokenizer
from jaxscale.errors import require, require_choice
from jaxscale.names import TRAIN_ON

USAGE = ("usage: python -m jaxscale.prepare --input=FILES_DIRS_OR_GLOBS --out=STORE [--tokenizer=bytes|tokenizer.json"
         "|tiktoken:NAME] [--text_field=text] [--workers=N (default: one per core)] [--shard_mb=64] "
         "[--progress=true] [--chat_template=TEMPLATE] [--train_on=all|assistant|completion]")
FLAGS = {"input": str, "out": str, "tokenizer": str, "text_field": str, "workers": int, "shard_mb": float,
         "progress": bool, "chat_template": str, "train_on": str}


def _bar(enabled: bool, total: int):
    """A rich progress bar of input bytes with tokens/s and the time left (None when disabled)."""
    if not enabled:
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rate]}"),
                   TextColumn("ETA"), TimeRemainingColumn())
    bar.add_task("prepare", total=total, rate="")
    return bar


def _watch(bar, counters: list, start: float, stop: threading.Event) -> None:
    """Refresh the bar from the workers' counters until `stop`."""
    while not stop.is_set():
        stop.wait(0.2)
        if counters:
            done, tokens = counters[0].read()
            rate = f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s"
            bar.update(bar.task_ids[0], completed=done, rate=rate)


def _own_peak_mib() -> float:
    """This process's peak resident memory since it started this program: VmHWM, which exec
    resets (getrusage's peak would include the process that forked us), else getrusage's."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS: rough


def _peak_memory(workers: int) -> str:
    """Peak resident memory of this process and of the largest worker (forked from this one)."""
    own = _own_peak_mib()
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if workers <= 1:
        return f"peak memory {own:.0f} MiB"
    return f"peak memory {own:.0f} MiB + {workers} workers x <= {child:.0f} MiB = <= {own + workers * child:.0f} MiB"


def prepare(flags: dict, say=print) -> dict:
    """Prepare (or complete) the store flags['out'] describes; its finished manifest."""
    for name in ("input", "out"):
        require(bool(flags.get(name)), f"--{name}", flags.get(name, ""), f"missing; {USAGE}")
    workers, shard_mb = flags.get("workers", os.cpu_count() or 1), flags.get("shard_mb", 64.0)
    require(workers >= 1, "--workers", workers, "must be >= 1")
    require(shard_mb > 0, "--shard_mb", shard_mb, "must be > 0 (input megabytes per shard)")
    spec, text_field, out = flags.get("tokenizer", "bytes"), flags.get("text_field", "text"), Path(flags["out"])
    chat = {"template": flags.get("chat_template", ""), "train_on": flags.get("train_on", "assistant")}
    require_choice("--train_on", chat["train_on"], TRAIN_ON)
    with build_store.flag_errors():
        tokenizer = load_tokenizer(spec)
        manifest, units = build_store.plan(flags["input"], tokenizer, spec, text_field, max(1, int(shard_mb * 2**20)),
                                           chat)
    build_store.begin(out, manifest)
    written = {i for i in range(len(units)) if store.is_done(out, i)}
    todo = [(i, u, str(out), text_field) for i, u in enumerate(units) if i not in written]
    kept = sum(units[i].size for i in written)
    if len(todo) < len(units):
        say(f"continuing {out}: {len(units) - len(todo)} of {len(units)} shards were written before")
    total, start, counters = sum(u.size for u in units), time.perf_counter(), []
    bar, stop = _bar(flags.get("progress", True), total), threading.Event()

    def counters_for(shared):
        counters.append(build_store.Counters(shared))
        counters[0].add(kept, 0)
        return counters[0]

    watcher = threading.Thread(target=_watch, args=(bar, counters, start, stop), daemon=True) if bar else None
    with bar or contextlib.nullcontext():
        if watcher:
            watcher.start()
        try:
            with build_store.flag_errors():
                build_store.run(todo, spec, workers, counters_for, lambda index: None, manifest.get("chat"))
        finally:
            stop.set()
            if watcher:
                watcher.join()
    done = build_store.finish(out, manifest)
    seconds = time.perf_counter() - start
    made = sum(done["shards"][task[0]]["tokens"] for task in todo)
    say(f"prepared {out}: {len(units)} shards, {done['tokens']:,} tokens, {done['documents']:,} documents from "
        f"{total / 2**20:,.1f} MiB; {made:,} tokens in {seconds:.1f}s ({made / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{min(workers, max(len(todo), 1))} workers); {_peak_memory(min(workers, len(todo)))}")
    return done


def main(argv: list[str] | None = None) -> int:
    return cli.run(lambda args: prepare(cli.parse_named(args, USAGE, FLAGS)) and None, USAGE, argv)


if __name__ == "__main__":
    sys.exit(main())
