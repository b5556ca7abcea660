"""Text pieces to token ids: documents joined with the tokenizer's EOS id, encoded in batches.

Shared by the token store's writer (python -m jaxscale.prepare) and by text sources read at
every start without a store, so both give the same ids for the same text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from jaxscale.data.formats import Piece
from jaxscale.data.tokenize import Tokenizer

BATCH_CHARS = 1 << 20  # text encoded at once: the tokenizer's batch, and a worker's memory
BATCH_PIECES = 1024


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (nanoGPT's choice), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encoded(pieces: Iterable[Piece], tokenizer: Tokenizer) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(ids, ends, position) per batch of pieces: the ids with EOS after each document's last
    piece, the offsets within `ids` just after each EOS, and the bytes of input read so far."""
    dtype, eos = token_dtype(tokenizer.vocab_size), np.array([tokenizer.eos_id])
    for batch in _batches(pieces):
        parts, ends, length = [], [], 0
        for (_, ends_document, _), ids in zip(batch, tokenizer.encode_batch([text for text, _, _ in batch])):
            parts.append(ids)
            length += len(ids)
            if ends_document:
                parts.append(eos)
                length += 1
                ends.append(length)
        yield np.concatenate(parts).astype(dtype), np.asarray(ends, np.uint64), batch[-1][2]


def encode_all(pieces: Iterable[Piece], tokenizer: Tokenizer) -> np.ndarray:
    """Every piece's ids, EOS after each document, as one uint16 (or uint32) array."""
    parts = [ids for ids, _, _ in encoded(pieces, tokenizer)]
    return np.concatenate(parts) if parts else np.zeros(0, token_dtype(tokenizer.vocab_size))
