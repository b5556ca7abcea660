"""Sources: where tokens come from. Text sources give documents; token files give ids directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxscale.errors import ConfigError

TEXT_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")


def embedded_documents() -> Iterator[str]:
    """Real English text shipped with every CPython: the pydoc topic pages (about 0.47 MB)."""
    from pydoc_data.topics import topics

    return (topics[key] for key in sorted(topics))


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError("data.path", str(path), f"line {number} is not JSON ({error}); give one object per line") from None
            if field not in record:
                raise ConfigError("data.text_field", field, f"line {number} of {path} has keys {sorted(record)}; name the text key")
            yield record[field]


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data.path", str(path), "Parquet needs pyarrow: pip install 'jaxscale[parquet]'") from None
    table = pq.read_table(path)
    if field not in table.column_names:
        raise ConfigError("data.text_field", field, f"{path} has columns {table.column_names}; name the text column")
    return iter(table.column(field).to_pylist())


def file_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of a text file (the whole file), a JSONL file or a Parquet file."""
    if path.suffix == ".parquet":
        return _parquet_documents(path, text_field)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_documents(path, text_field)
    return iter([path.read_bytes().decode("utf-8", errors="replace")])


def token_file(path: Path, token_dtype: str) -> np.ndarray:
    """Pre-tokenized ids, memory-mapped: nanoGPT .bin (raw `token_dtype`) or a 1-D .npy."""
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError("data.path", str(path), f"expected a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
        return tokens
    if token_dtype not in ("uint16", "uint32"):
        raise ConfigError("data.token_dtype", token_dtype, "use uint16 (vocab <= 65536) or uint32")
    return np.memmap(path, dtype=token_dtype, mode="r")


def check_path(path_text: str) -> Path:
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError("data.path", path_text, "no such file; give a .txt, .jsonl, .parquet, .bin or .npy file")
    return path


def encode_documents(documents, tokenizer) -> np.ndarray:
    """Concatenate encoded documents, each followed by the tokenizer's EOS id."""
    pieces = []
    for text in documents:
        pieces.extend(tokenizer.encode(text))
        pieces.append(tokenizer.eos_id)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    return np.asarray(pieces, dtype=dtype)


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id, scanning a memory map in chunks so it never loads at once."""
    return max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
