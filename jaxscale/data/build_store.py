"""Preparing a token store: plan the units of work, then tokenize them in worker processes.

The plan (inputs, tokenizer, text field, unit size, one shard per unit) is the store's manifest,
written before any shard. Run again on the same store, the plan must be the same: the shards that
exist are kept, the rest are written, and the manifest is completed with each shard's counts. The
workers are spawned (never forked from a process that may hold threads) and import no JAX; each
holds one batch of text and its ids at a time, so memory does not grow with the corpus.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

from jaxscale.data import chat, encode, formats, store
from jaxscale.data.tokenize import Tokenizer, load_tokenizer
from jaxscale.errors import ConfigError, RunError

# Field names of the errors the data readers raise, as prepare's flags.
FLAGS = {formats.PATH: "--input", formats.TEXT_FIELD: "--text_field", "data.tokenizer": "--tokenizer",
         chat.FIELD: "--chat_template"}
Task = tuple[int, formats.Unit, str, str]  # (shard index, unit, store directory, text field)
PLAN_KEYS = ("name", "input", "kind", "start", "stop")  # a shard's entry in the plan


@contextlib.contextmanager
def flag_errors():
    """ConfigErrors of the data readers, renamed to the flag the user set."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(FLAGS.get(error.field, error.field), error.value, error.fix) from None


def _tokenizer_spec(spec: str) -> str:
    """The spec as recorded: a tokenizer.json path made absolute, so a resume from elsewhere matches."""
    return spec if spec == "bytes" or spec.startswith("tiktoken:") else str(Path(spec).resolve())


def plan(inputs: str, tokenizer: Tokenizer, spec: str, text_field: str, unit_bytes: int,
         chat_settings: dict) -> tuple[dict, list]:
    """(the store's manifest before any shard is written, its units of work, one per shard).
    Chat records (jaxscale.data.chat) are rendered with chat_settings ({'template', 'train_on'})
    and stored with their loss mask, one shard per file."""
    paths = formats.expand(inputs)
    for path in paths:
        if path.is_dir() or formats.kind_of(path) == "tokens":
            raise ConfigError(formats.PATH, str(path), "is tokenized already; give it to data.path as it is")
    chats = [path for path in paths if chat.is_chat(path, text_field)]
    if chats and len(chats) < len(paths):
        other = next(path for path in paths if path not in chats)
        raise ConfigError(formats.PATH, str(other), f"is not chat records, beside {chats[0]}; prepare them "
                          "into separate stores")
    unit_bytes = sys.maxsize if chats else unit_bytes  # a chat file is rendered whole
    units = [(number, unit) for number, path in enumerate(paths) for unit in formats.units(path, unit_bytes)]
    stats = [path.stat() for path in paths]
    manifest = {
        "format": store.FORMAT, "complete": False, "text_field": text_field, "unit_bytes": unit_bytes,
        "tokenizer": {"spec": _tokenizer_spec(spec), "identity": tokenizer.identity,
                      "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
        "dtype": encode.token_dtype(tokenizer.vocab_size).name,
        "inputs": [{"path": str(p.resolve()), "bytes": s.st_size, "mtime_ns": s.st_mtime_ns}
                   for p, s in zip(paths, stats)],
        "shards": [dict(zip(PLAN_KEYS, (store.shard_name(i), number, unit.kind, unit.start, unit.stop)))
                   for i, (number, unit) in enumerate(units)],
        **({"chat": dict(chat_settings)} if chats else {}),
    }
    return manifest, [unit for _, unit in units]


def begin(out: Path, manifest: dict) -> None:
    """Start the store at `out`, or continue the one there if it was begun with the same plan."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / store.MANIFEST).exists():
        if _plan_of(store.read_manifest(out, "--out")) != _plan_of(manifest):
            raise ConfigError("--out", str(out), "holds a store begun from other inputs or settings; "
                              "use a new --out, or run the command that began it")
    elif any(out.iterdir()):
        raise ConfigError("--out", str(out), "is a directory with other files in it; name a new or empty one")
    else:
        store.write_json(out / store.MANIFEST, manifest)
    store.remove_partial(out)


def _plan_of(manifest: dict) -> dict:
    """A manifest without what finish() adds (the completion flag, totals, per-shard counts)."""
    plan = {k: v for k, v in manifest.items() if k not in ("complete", "shards", "tokens", "documents")}
    return {**plan, "shards": [{k: s[k] for k in PLAN_KEYS} for s in manifest.get("shards", [])]}


def finish(out: Path, manifest: dict) -> dict:
    """The manifest completed with every shard's counts and the totals, written."""
    dtype = encode.token_dtype(manifest["tokenizer"]["vocab_size"])
    shards = [{**shard, **store.shard_counts(out, i, dtype)} for i, shard in enumerate(manifest["shards"])]
    done = {**manifest, "shards": shards, "complete": True,
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards)}
    store.write_json(out / store.MANIFEST, done)
    return done


# --- the work ----------------------------------------------------------------------------------

_WORKER: dict = {}  # in each worker process: its tokenizer, the shared counters, the parent's pid


def init_worker(spec: str, counters, parent: int, chat_settings: dict | None = None) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per worker: no tokenizer thread pools
    _WORKER.update(tokenizer=load_tokenizer(spec), counters=counters, parent=parent, spec=spec, chat=chat_settings)


class Counters:
    """Input bytes read and tokens written, summed over the workers: shared memory, or plain ints
    when the work runs in this process."""

    def __init__(self, shared=None):
        self.shared, self.local = shared, [0, 0]

    def add(self, size: int, tokens: int) -> None:
        if self.shared is None:
            self.local[0] += size
            self.local[1] += tokens
            return
        with self.shared.get_lock():
            self.shared[0] += size
            self.shared[1] += tokens

    def read(self) -> tuple[int, int]:
        return tuple(self.local) if self.shared is None else (self.shared[0], self.shared[1])


def work(task: Task) -> int:
    """Write one shard (in a worker, or in this process); its index."""
    index, unit, out, text_field = task
    counters, read = _WORKER["counters"], [0]

    def progress(tokens: int, position: int) -> None:
        if os.getppid() != _WORKER["parent"]:
            os._exit(1)  # the prepare that started this worker is gone (killed): stop with it
        position = min(position, unit.size)
        counters.add(position - read[0], tokens)
        read[0] = position

    try:
        if _WORKER["chat"] is not None:
            _write_chat(Path(out), index, unit, progress)
        else:
            store.write_shard(Path(out), index, encode.encoded(formats.read(unit, text_field), _WORKER["tokenizer"]),
                              progress)
    except OSError as error:
        if error.filename and str(Path(error.filename).parent) == str(Path(out)):
            raise RunError(f"cannot write the store {out}: {error}") from None
        raise ConfigError(formats.PATH, unit.path, f"cannot be read ({error}); fix or remove it") from None
    counters.add(unit.size - read[0], 0)
    return index


def _write_chat(out: Path, index: int, unit: formats.Unit, progress: Callable[[int, int], None]) -> None:
    """A chat file's shard: its records rendered (jaxscale.data.chat), with their loss mask."""
    settings, tokenizer, path = _WORKER["chat"], _WORKER["tokenizer"], Path(unit.path)
    template = chat.load_template(settings["template"], _WORKER["spec"]) \
        if chat.needs_template(path, settings["template"]) else None
    tokens, mask, ends = chat.encode_records(formats.records(path), template, tokenizer, settings["train_on"])
    store.write_shard(out, index, [(tokens, ends, unit.size)], progress, mask)


def run(tasks: list[Task], spec: str, workers: int, counters_for: Callable[[object], Counters],
        on_done: Callable[[int], None], chat_settings: dict | None = None) -> None:
    """Every task, in `workers` spawned processes (in this one when there is one worker or task);
    on_done(index) as each shard lands. counters_for(shared or None) makes the progress counters."""
    if workers <= 1 or len(tasks) <= 1:
        init_worker(spec, counters_for(None), os.getppid(), chat_settings)
        for task in tasks:
            on_done(work(task))
        return
    context = multiprocessing.get_context("spawn")
    counters = counters_for(context.Array("q", 2))
    pool = context.Pool(min(workers, len(tasks)), init_worker, (spec, counters, os.getpid(), chat_settings))
    try:
        for index in pool.imap_unordered(work, tasks):
            on_done(index)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
