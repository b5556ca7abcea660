"""The token store: a corpus tokenized once (`python -m jaxscale.prepare`), read memory-mapped.

    STORE/manifest.json          what it was made from (inputs, text field, unit size), the
                                 tokenizer's identity, the token dtype and each shard's source;
                                 once complete, each shard's token and document counts
    STORE/shard-00000.bin        token ids, uint16 or uint32 (nanoGPT's flat layout), each
                                 document followed by the tokenizer's EOS id
    STORE/shard-00000.docs.bin   the document index: uint64 offsets, 0 and then the end of each
                                 document (document k is ids [docs[k], docs[k+1]), its EOS last)
    STORE/shard-00000.mask.bin   chat records only (the manifest's "chat"): the loss mask, uint8,
                                 1 for each id that is trained (jaxscale.data.chat)

A shard is a pure function of its unit of input. It is written under a temporary name and renamed
when whole (its index first, its ids last), so a prepare killed at any moment and run again keeps
the shards that exist and writes the same bytes as a prepare that never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from jaxscale.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = "jaxscale.token_store/1"
PARTIAL = ".tmp-"  # in the names of files being written
MASK = ".mask.bin"  # a chat shard's loss mask beside its ids


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_json(path: Path, value: dict) -> None:
    """Written whole or not at all: a temporary file renamed over the old one."""
    partial = path.with_name(f"{path.name}{PARTIAL}{os.getpid()}")
    partial.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


def read_manifest(store: Path, field: str) -> dict:
    try:
        manifest = json.loads((store / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(field, str(store), f"its {MANIFEST} does not read ({error}); prepare the store again") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(field, str(store), f"{MANIFEST} is not a {FORMAT} manifest; prepare the store again")
    return manifest


def is_done(store: Path, index: int) -> bool:
    return (store / f"{shard_name(index)}.bin").is_file()


def remove_partial(store: Path) -> None:
    """Files an interrupted prepare was writing (their shards are written again)."""
    for path in store.glob(f"*{PARTIAL}*"):
        path.unlink(missing_ok=True)


def write_shard(store: Path, index: int, chunks: Iterable[tuple[np.ndarray, np.ndarray, int]],
                progress: Callable[[int, int], None], mask: np.ndarray | None = None) -> None:
    """Shard `index` from (ids, document ends within ids, input position) chunks; calls
    progress(tokens, input position) after each. Chat records' shards have their `mask` too."""
    suffixes = (".docs.bin", *((MASK,) if mask is not None else ()), ".bin")
    final = {suffix: store / f"{shard_name(index)}{suffix}" for suffix in suffixes}
    partial = {suffix: path.with_name(f"{path.name}{PARTIAL}{os.getpid()}") for suffix, path in final.items()}
    with open(partial[".bin"], "wb") as ids_file, open(partial[".docs.bin"], "wb") as docs_file:
        docs_file.write(np.zeros(1, np.uint64).tobytes())
        written = 0
        for ids, ends, position in chunks:
            ids_file.write(ids.tobytes())
            docs_file.write((ends + np.uint64(written)).tobytes())
            written += len(ids)
            progress(len(ids), position)
    if mask is not None:
        partial[MASK].write_bytes(np.asarray(mask, np.uint8).tobytes())
    for suffix in suffixes:  # the ids last: a shard exists once they do
        os.replace(partial[suffix], final[suffix])


def shard_counts(store: Path, index: int, dtype: np.dtype) -> dict:
    """{'tokens', 'documents'} of a written shard, from its files' sizes."""
    name = shard_name(index)
    tokens = (store / f"{name}.bin").stat().st_size // dtype.itemsize
    documents = (store / f"{name}.docs.bin").stat().st_size // 8 - 1
    return {"tokens": tokens, "documents": documents}


@dataclasses.dataclass
class Store:
    """A complete store's token ids, one memory map per shard (never read whole)."""

    path: Path
    manifest: dict
    shards: list[np.ndarray]
    masks: list[np.ndarray] | None = None  # chat records' loss masks, one per shard (uint8 memory maps)

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def chat(self) -> dict | None:
        """How chat records were rendered: {'template', 'train_on'}; None for text."""
        return self.manifest.get("chat")

    def documents(self, index: int) -> np.ndarray:
        """Shard `index`'s document index (see the module docstring), memory-mapped."""
        return np.memmap(self.path / f"{shard_name(index)}.docs.bin", dtype=np.uint64, mode="r")


def _shard(path: Path, tokens: int, dtype: np.dtype, field: str) -> np.ndarray:
    try:
        with open(path, "rb"):
            size = path.stat().st_size
    except OSError as error:
        raise ConfigError(field, str(path), f"the shard is unreadable ({error.strerror}); restore it or "
                          "prepare the store again") from None
    if size != tokens * dtype.itemsize:
        raise ConfigError(field, str(path), f"holds {size:,} bytes where the manifest says {tokens:,} "
                          f"{dtype.name} ids; the shard is damaged: prepare the store again")
    return np.memmap(path, dtype=dtype, mode="r") if tokens else np.zeros(0, dtype)


def open_store(path: Path, field: str) -> Store:
    """A complete store with every shard present at its recorded size; ConfigError(field) else."""
    manifest = read_manifest(path, field)
    if not manifest.get("complete"):
        done = sum(is_done(path, i) for i in range(len(manifest["shards"])))
        raise ConfigError(field, str(path), f"prepare did not finish ({done} of {len(manifest['shards'])} shards); "
                          "run the same prepare command again to complete it")
    dtype = np.dtype(manifest["dtype"])
    shards = [_shard(path / f"{s['name']}.bin", s["tokens"], dtype, field) for s in manifest["shards"]]
    masks = None if "chat" not in manifest else [
        _shard(path / f"{s['name']}{MASK}", s["tokens"], np.dtype(np.uint8), field) for s in manifest["shards"]]
    return Store(path, manifest, shards, masks)
