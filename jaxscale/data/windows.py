"""Packing: a token stream cut into fixed-length training windows, and the held-out split.

A window is seq_len+1 consecutive tokens; windows start every seq_len tokens, so each token
(after the first) is a target exactly once per epoch. The last val_fraction of the stream is
validation (nanoGPT-style), and no window crosses the cut, so the splits share no target.

With document masking each window also carries its inputs' segment ids: documents end with the
tokenizer's EOS id (text sources put one after each document, and pre-tokenized streams are
expected to), so a new document starts after each EOS among the inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxscale.errors import ConfigError

Example = dict[str, np.ndarray]  # {'inputs', 'targets'} (+ 'segments'): int32 [seq_len]
NO_EOS = -1  # an eos_id no token has: each window one document


def example(window: np.ndarray, eos_id: int | None = None) -> Example:
    """inputs = window[:-1], targets = window[1:], both int32; given eos_id, also segments: each
    input's document number within the window (0 first, one more after each EOS input)."""
    window = np.asarray(window, dtype=np.int32)
    inputs = window[:-1]
    if eos_id is None:
        return {"inputs": inputs, "targets": window[1:]}
    segments = np.concatenate([[0], np.cumsum(inputs[:-1] == eos_id)]).astype(np.int32)
    return {"inputs": inputs, "targets": window[1:], "segments": segments}


class TokenWindows(Sequence):
    """Random access to the windows of a (possibly memory-mapped) token stream; indices wrap.
    Given eos_id, each window carries segment ids (see example)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int | None = None):
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, eos_id
        self._count = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Example:
        start = (index % self._count) * self.seq_len
        # Slicing a memmap reads only these seq_len+1 tokens from disk.
        return example(self.tokens[start:start + self.seq_len + 1], self.eos_id)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): validation is the last val_fraction of the stream. Views, no copies."""
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def train_val_windows(tokens: np.ndarray, seq_len: int, val_fraction: float,
                      eos_id: int | None = None) -> tuple[TokenWindows, TokenWindows]:
    """Windows of both splits (with segment ids split at eos_id, if given); ConfigError when
    either split is too short for one window."""
    train, val = split(tokens, val_fraction)
    if len(train) <= seq_len:
        fix = (f"the training split has only {len(train)} tokens, fewer than seq_len+1; "
               "use more data (data.path) or a shorter train.seq_len")
        raise ConfigError("train.seq_len", seq_len, fix)
    if len(val) <= seq_len:
        fix = (f"the validation split has only {len(val)} tokens, fewer than train.seq_len+1={seq_len + 1}; "
               "raise data.val_fraction, use more data or a shorter seq_len")
        raise ConfigError("data.val_fraction", val_fraction, fix)
    return TokenWindows(train, seq_len, eos_id), TokenWindows(val, seq_len, eos_id)
