"""The synthetic source: learnable pseudo-random windows that need no file.

Each window is an arithmetic progression mod vocab with a random start and a small random
stride, so after one token the rest is predictable from the first two: a model's loss can
fall to near zero, which makes this source a quick end-to-end check of training.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxscale.data.windows import NO_EOS, Example, example

TRAIN_WINDOWS = 1 << 20
VAL_WINDOWS = 1 << 12
MAX_STRIDE = 7


class SyntheticWindows(Sequence):
    """Window i is a pure function of (seed, stream, i): random access, identical on every process.

    stream 0 is training and stream 1 validation, so the two never share a random draw.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, stream: int = 0,
                 count: int = TRAIN_WINDOWS, segments: bool = False):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.stream, self._count = stream, count
        self._eos = NO_EOS if segments else None  # with segment ids, each window is one document

    def __len__(self) -> int:
        return self._count

    def _entropy(self, index: int) -> list[int]:
        # Training keeps the plain [seed, index] key; validation appends its stream tag.
        index %= self._count
        return [self.seed, index] if self.stream == 0 else [self.seed, index, self.stream]

    def __getitem__(self, index: int) -> Example:
        rng = np.random.default_rng(self._entropy(index))
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, MAX_STRIDE + 1)
        return example((start + stride * np.arange(self.seq_len + 1)) % self.vocab_size, self._eos)


def synthetic_splits(vocab_size: int, seq_len: int, seed: int,
                     segments: bool = False) -> tuple[SyntheticWindows, SyntheticWindows]:
    """(training windows, validation windows) from separate random streams; with segments, each
    window carries segment ids (all 0: one document)."""
    return (SyntheticWindows(vocab_size, seq_len, seed, stream=0, count=TRAIN_WINDOWS, segments=segments),
            SyntheticWindows(vocab_size, seq_len, seed, stream=1, count=VAL_WINDOWS, segments=segments))
