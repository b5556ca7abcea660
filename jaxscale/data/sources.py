"""Sources: where a run's token streams come from.

A source is named by comma-separated token stores, files, directories and globs
(`data.path`, or one entry of `data.mixture`), read in that order as a list of pieces: one per
store shard or file. Stores (python -m jaxscale.prepare) and pre-tokenized files (.bin, .npy) are
memory-mapped, never read whole; text and document files without a store are encoded at every
start, which suits small data (the run says once that `prepare` exists). Chat records
(jaxscale.data.chat) are rendered and encoded at every start too, with their loss mask.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxscale.data import chat, formats, pairs, store
from jaxscale.data.encode import encode_all
from jaxscale.data.formats import Piece
from jaxscale.data.settings import DataSettings
from jaxscale.data.tokenize import Tokenizer
from jaxscale.errors import ConfigError

PREPARE_NOTE = ("data: {files} read and tokenized at every start ({mib:.1f} MiB); for large data tokenize once with "
                "python -m jaxscale.prepare --input=... --out=STORE and set data.path=STORE")


@dataclasses.dataclass
class Source:
    """A named token stream: its pieces in order, and its weight in a mixture; a chat source's
    loss masks, one per piece (1 where a token is trained), else None."""

    name: str
    pieces: list[np.ndarray]
    weight: float = 1.0
    encoded_bytes: int = 0   # of text encoded at this start (0 when every piece is memory-mapped)
    masks: list[np.ndarray] | None = None
    pairs: tuple[np.ndarray, np.ndarray] | None = None  # preference pairs' (tokens, mask) (jaxscale.data.pairs)


def embedded_pieces() -> list[Piece]:
    """Real English text shipped with every CPython: the pydoc topic pages (about 0.47 MB), by sorted key."""
    from pydoc_data.topics import topics

    return [(topics[key], True, 0) for key in sorted(topics)]


def _npy_tokens(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as error:
        fix = f"not a NumPy .npy array ({error}); save ids with np.save"
        raise ConfigError("data.path", str(path), fix) from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        fix = f"holds {tokens.dtype}{list(tokens.shape)}; save a 1-D integer array"
        raise ConfigError("data.path", str(path), fix)
    return tokens


def token_file(path: Path, token_dtype: str) -> np.ndarray:
    """Pre-tokenized ids, memory-mapped: a 1-D .npy, or a nanoGPT .bin of raw `token_dtype`."""
    if path.suffix == ".npy":
        return _npy_tokens(path)
    size, itemsize = path.stat().st_size, np.dtype(token_dtype).itemsize
    if size % itemsize:
        fix = f"{path} has {size} bytes, not whole {token_dtype} ids; set the dtype the file was written with"
        raise ConfigError("data.token_dtype", token_dtype, fix)
    if size == 0:  # mmap cannot map an empty file; the too-little-data check reports it
        return np.zeros(0, token_dtype)
    return np.memmap(path, dtype=token_dtype, mode="r")


def token_range(tokens: np.ndarray, chunk: int = 1 << 24) -> tuple[int, int]:
    """(smallest, largest) id, scanning in chunks so a memory map is never loaded at once."""
    parts = [tokens[i:i + chunk] for i in range(0, len(tokens), chunk)]
    low = min((int(part.min()) for part in parts), default=0)
    return low, max((int(part.max()) for part in parts), default=-1)


def check_tokenizer_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"the tokenizer has {tokenizer.vocab_size} tokens; "
                          f"set model.vocab_size >= {tokenizer.vocab_size}")


def _checked_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> np.ndarray:
    low, high = token_range(tokens)
    if low < 0:
        raise ConfigError("data.path", str(path), f"holds a negative token id ({low}); token ids must be >= 0")
    if high >= vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"{path} has token ids up to {high}; "
                          f"set model.vocab_size >= {high + 1}")
    return tokens


def _open_store(path: Path, settings: DataSettings, tokenizer: Tokenizer, field: str) -> store.Store:
    opened = store.open_store(path, field)
    made_with = opened.tokenizer
    if made_with["identity"] != tokenizer.identity:
        raise ConfigError("data.tokenizer", settings.tokenizer, f"{path} was prepared with {made_with['spec']} "
                          f"({made_with['identity']}); set data.tokenizer={made_with['spec']}")
    if opened.chat is not None and opened.chat["train_on"] != settings.train_on:
        made = opened.chat["train_on"]
        raise ConfigError("data.train_on", settings.train_on, f"{path} holds chat records masked with train_on={made}; "
                          f"set data.train_on={made}, or prepare it again with --train_on={settings.train_on}")
    check_tokenizer_vocab(tokenizer, settings.vocab_size)
    return opened


def load(name: str, spec: str, settings: DataSettings, tokenizer: Tokenizer, field: str = "data.path",
         weight: float = 1.0) -> Source:
    """The source `spec` names, every file checked; ConfigError(field or the part at fault) else."""
    paths = formats.expand(spec, field)
    paired = [path for path in paths if path.is_file() and pairs.is_pairs(path)]
    if paired or settings.pairs:
        return _pair_source(name, paths, paired, settings, tokenizer, field, weight)
    chats = [path for path in paths if path.is_file() and chat.is_chat(path, settings.text_field)]
    if chats:
        return _chat_source(name, paths, chats, settings, tokenizer, field, weight)
    pieces, encoded, masks = [], 0, []
    for path in paths:
        if path.is_dir():
            opened = _open_store(path, settings, tokenizer, field)
            pieces += opened.shards
            masks += opened.masks or [None] * len(opened.shards)
        elif formats.kind_of(path) == "tokens":
            pieces.append(_checked_ids(token_file(path, settings.token_dtype), settings.vocab_size, path))
        else:
            check_tokenizer_vocab(tokenizer, settings.vocab_size)  # before encoding, so a mismatch fails fast
            pieces.append(encode_all(formats.read(formats.whole_file(path), settings.text_field), tokenizer))
            encoded += path.stat().st_size
    return Source(name, pieces, weight, encoded, _store_masks(masks, len(pieces), paths, field))


def _store_masks(masks: list, pieces: int, paths: list[Path], field: str) -> list[np.ndarray] | None:
    """The chat stores' masks, one per piece, when every piece is a chat store's; None when none is."""
    if not any(mask is not None for mask in masks):
        return None
    if len(masks) < pieces or any(mask is None for mask in masks):
        raise ConfigError(field, ",".join(str(p) for p in paths), "mixes a store of chat records with other data "
                          "in one source; give them as separate sources of data.mixture")
    return masks


def _chat_source(name: str, paths: list[Path], chats: list[Path], settings: DataSettings, tokenizer: Tokenizer,
                 field: str, weight: float) -> Source:
    """A source of chat records only: each file's tokens and loss mask."""
    other = next((path for path in paths if path not in chats), None)
    if other is not None:
        raise ConfigError(field, str(other), f"is not chat records, beside {chats[0]}; give chat and other data as "
                          "separate sources of data.mixture")
    check_tokenizer_vocab(tokenizer, settings.vocab_size)
    template = chat.load_template(settings.chat_template, settings.tokenizer) if _needs_template(chats, settings) \
        else None
    encoded = [chat.encode(path, template, tokenizer, settings.train_on) for path in chats]
    return Source(name, [tokens for tokens, _ in encoded], weight, sum(path.stat().st_size for path in chats),
                  [mask for _, mask in encoded])


def _pair_source(name: str, paths: list[Path], paired: list[Path], settings: DataSettings, tokenizer: Tokenizer,
                 field: str, weight: float) -> Source:
    """A source of preference pairs only, when preference tuning is on (and only then)."""
    if not settings.pairs:
        raise ConfigError(field, str(paired[0]), "holds preference pairs (prompt, chosen, rejected); tune on them "
                          "with --config.preference.loss=dpo (or simpo)")
    other = next((path for path in paths if path not in paired), None)
    if other is not None:
        raise ConfigError(field, str(other), "is not preference records (prompt, chosen and rejected); "
                          "preference.loss tunes on those alone")
    check_tokenizer_vocab(tokenizer, settings.vocab_size)
    template = chat.load_template(settings.chat_template, settings.tokenizer) if _needs_template(paired, settings) \
        else None
    encoded = [pairs.encode(path, template, tokenizer, settings.seq_len) for path in paired]
    return Source(name, [], weight, sum(path.stat().st_size for path in paired),
                  pairs=tuple(np.concatenate(parts) for parts in zip(*encoded)))


def _needs_template(paths: list[Path], settings: DataSettings) -> bool:
    return chat.needs_template(paths[0], settings.chat_template)


def embedded(settings: DataSettings, tokenizer: Tokenizer) -> Source:
    check_tokenizer_vocab(tokenizer, settings.vocab_size)
    return Source("embedded", [encode_all(embedded_pieces(), tokenizer)])
