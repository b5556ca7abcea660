"""Sources: where the token stream comes from (the embedded corpus, or one file).

Text sources give documents, encoded and joined with the tokenizer's EOS id after each one;
pre-tokenized files (.bin, .npy) give ids directly and are memory-mapped, never read whole.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxscale.data.settings import DataSettings
from jaxscale.data.tokenize import Tokenizer
from jaxscale.errors import ConfigError

DOCUMENT_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_SUFFIXES = (".txt", ".md")  # other suffixes are read as text too, if they look like text
SUPPORTED = "use .txt/.md (text), .jsonl/.json/.parquet (documents) or .bin/.npy (token ids)"


def embedded_documents() -> Iterator[str]:
    """Real English text shipped with every CPython: the pydoc topic pages (about 0.47 MB), by sorted key."""
    from pydoc_data.topics import topics

    return (topics[key] for key in sorted(topics))


def _text_value(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        fix = f"{where} holds {type(value).__name__}, not text; name a string field"
        raise ConfigError("data.text_field", field, fix)
    return value


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                fix = f"line {number} is not JSON ({error}); give one object per line"
                raise ConfigError("data.path", str(path), fix) from None
            if not isinstance(record, dict):
                fix = f"line {number} is a JSON {type(record).__name__}; give one object per line"
                raise ConfigError("data.path", str(path), fix)
            if field not in record:
                fix = f"line {number} of {path} has keys {sorted(record)}; name the text key"
                raise ConfigError("data.text_field", field, fix)
            yield _text_value(record[field], f"line {number} of {path}", field)


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        fix = "Parquet needs pyarrow: pip install 'jaxscale[parquet]'"
        raise ConfigError("data.path", str(path), fix) from None
    columns = pq.read_schema(path).names
    if field not in columns:
        raise ConfigError("data.text_field", field, f"{path} has columns {columns}; name the text column")
    values = pq.read_table(path, columns=[field]).column(field).to_pylist()  # only the text column
    return (_text_value(v, f"row {i} of {path}", field) for i, v in enumerate(values))


def _looks_binary(path: Path) -> bool:
    # NUL bytes do not occur in real text but fill compressed and binary formats.
    with open(path, "rb") as head:
        return b"\0" in head.read(1 << 16)


def _text_documents(path: Path) -> Iterator[str]:
    if path.suffix not in TEXT_SUFFIXES and _looks_binary(path):
        fix = f"unknown extension {path.suffix!r} and not text; {SUPPORTED}"
        raise ConfigError("data.path", str(path), fix)
    return iter([path.read_bytes().decode("utf-8", errors="replace")])


def file_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of a JSONL/JSON-lines file, a Parquet file, or a text file (one document)."""
    if path.suffix == ".parquet":
        return _parquet_documents(path, text_field)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_documents(path, text_field)
    return _text_documents(path)


def encode_documents(documents: Iterable[str], tokenizer: Tokenizer, group: int = 512) -> np.ndarray:
    """Every document's ids followed by tokenizer.eos_id, as one uint16 (or uint32) array."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    eos, pieces, documents = np.array([tokenizer.eos_id], dtype), [], iter(documents)
    # Groups let Hugging Face tokenizers encode many documents in parallel.
    while texts := list(itertools.islice(documents, group)):
        for ids in tokenizer.encode_batch(texts):
            pieces += (ids.astype(dtype, copy=False), eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


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


def check_path(path_text: str) -> Path:
    """The data file as a Path; ConfigError(data.path) when it is not an existing file."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError("data.path", path_text, f"no such file; {SUPPORTED}")
    return path


def is_pretokenized(settings: DataSettings) -> bool:
    """Whether the source gives token ids directly (a .bin or .npy file), skipping the tokenizer."""
    return settings.source == "file" and Path(settings.path).suffix in TOKEN_SUFFIXES


def load_tokens(settings: DataSettings, tokenizer: Tokenizer) -> np.ndarray:
    """The whole token stream of the embedded or file source (memory-mapped when pre-tokenized)."""
    if settings.source == "embedded":
        return encode_documents(embedded_documents(), tokenizer)
    path = check_path(settings.path)
    if is_pretokenized(settings):
        return token_file(path, settings.token_dtype)
    return encode_documents(file_documents(path, settings.text_field), tokenizer)
