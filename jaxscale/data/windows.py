"""Packing: a token stream cut into training windows, and the learnable synthetic stream."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Example = dict[str, np.ndarray]  # {'inputs', 'targets'}: int32 [seq_len]


def _example(window: np.ndarray) -> Example:
    window = np.asarray(window, dtype=np.int32)
    return {"inputs": window[:-1], "targets": window[1:]}


class TokenWindows(Sequence):
    """Windows of seq_len+1 tokens with stride seq_len: every token is a target exactly once."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self._count = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Example:
        index = index % self._count
        start = index * self.seq_len
        return _example(self.tokens[start:start + self.seq_len + 1])


class SyntheticWindows(Sequence):
    """Deterministic arithmetic progressions mod vocab: random start and stride, so loss can fall."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, count: int = 1 << 20):
        self.vocab_size, self.seq_len, self.seed, self._count = vocab_size, seq_len, seed, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Example:
        rng = np.random.default_rng([self.seed, index % self._count])
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, 8)
        return _example((start + stride * np.arange(self.seq_len + 1)) % self.vocab_size)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): validation is the last val_fraction of the stream (nanoGPT-style)."""
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]
