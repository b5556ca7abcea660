"""Packing: a token stream cut into fixed-length training windows, and the held-out split.

A window is seq_len+1 consecutive tokens; windows start every seq_len tokens, so each token
(after the first) is a target exactly once per epoch. A stream in pieces (a store's shards,
several files) is cut piece by piece, each losing under seq_len tokens at its end. The last
val_fraction of the stream is validation (nanoGPT-style), and no window crosses the cut, so the
splits share no target.

With document masking each window also carries its inputs' segment ids: documents end with the
tokenizer's EOS id (text sources put one after each document, and pre-tokenized streams are
expected to), so a new document starts after each EOS among the inputs.

Chat data (jaxscale.data.chat) comes with a loss mask, a stream beside the tokens cut the same
way: each window then carries `mask`, 1 where its target is trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxscale.errors import ConfigError

Example = dict[str, np.ndarray]  # {'inputs', 'targets'} (+ 'segments', 'mask'): int32 [seq_len]
NO_EOS = -1  # an eos_id no token has: each window one document


def example(window: np.ndarray, eos_id: int | None = None, mask: np.ndarray | None = None) -> Example:
    """inputs = window[:-1], targets = window[1:], both int32; given eos_id, also segments: each
    input's document number within the window (0 first, one more after each EOS input); given
    the window's mask (1 per trained token), also the targets' mask = mask[1:]."""
    window = np.asarray(window, dtype=np.int32)
    inputs = window[:-1]
    out = {"inputs": inputs, "targets": window[1:]}
    if eos_id is not None:
        out["segments"] = np.concatenate([[0], np.cumsum(inputs[:-1] == eos_id)]).astype(np.int32)
    if mask is not None:
        out["mask"] = np.asarray(mask[1:], dtype=np.int32)
    return out


class TokenWindows(Sequence):
    """Random access to the windows of a list of (possibly memory-mapped) token streams, each
    cut on its own (no window spans two pieces); indices wrap. Given eos_id, each window carries
    segment ids (see example); given masks (one per piece, as long), its loss mask, and with
    `masked` and no masks a mask of ones (a source without one, mixed with chat data)."""

    def __init__(self, pieces: list[np.ndarray], seq_len: int, eos_id: int | None = None,
                 masks: list[np.ndarray] | None = None, masked: bool = False):
        self.pieces, self.seq_len, self.eos_id, self.masks = pieces, seq_len, eos_id, masks
        self.masked = masked or masks is not None
        counts = [max(0, (len(piece) - 1) // seq_len) for piece in pieces]
        self._starts = np.cumsum([0] + counts)  # the first window of each piece
        self.tokens = sum(len(piece) for piece in pieces)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> Example:
        index %= len(self)
        piece = int(np.searchsorted(self._starts, index, side="right")) - 1
        start = (index - int(self._starts[piece])) * self.seq_len
        # Slicing a memmap reads only these seq_len+1 tokens from disk.
        window = slice(start, start + self.seq_len + 1)
        mask = self.masks[piece][window] if self.masks is not None else None
        if mask is None and self.masked:
            mask = np.ones(self.seq_len + 1, np.int32)
        return example(self.pieces[piece][window], self.eos_id, mask)


def split(pieces: list[np.ndarray], val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, validation) pieces: validation is the last val_fraction of the tokens of all the
    pieces in order, so it ends the last piece. Views, no copies."""
    total = sum(len(piece) for piece in pieces)
    cut, seen, train, val = total - int(total * val_fraction), 0, [], []
    for piece in pieces:
        inside = min(max(cut - seen, 0), len(piece))
        train += [piece[:inside]] if inside else []
        val += [piece[inside:]] if inside < len(piece) else []
        seen += len(piece)
    return train, val


def train_val_windows(pieces: list[np.ndarray], seq_len: int, val_fraction: float,
                      eos_id: int | None = None, name: str = "", masks: list[np.ndarray] | None = None,
                      masked: bool = False) -> tuple[TokenWindows, TokenWindows]:
    """Windows of both splits (with segment ids split at eos_id, if given; masks, as pieces, cut
    as they are; masked: see TokenWindows); ConfigError when either split is too short for one
    window."""
    cut = [split(part, val_fraction) if part is not None else (None, None) for part in (pieces, masks)]
    train, val = (TokenWindows(tokens, seq_len, eos_id, mask, masked) for tokens, mask in zip(*cut))
    source = f" of {name}" if name else ""
    if not len(train):
        fix = (f"the training split{source} has only {train.tokens} tokens, fewer than seq_len+1 in any piece; "
               "use more data (data.path) or a shorter train.seq_len")
        raise ConfigError("train.seq_len", seq_len, fix)
    if not len(val):
        fix = (f"the validation split{source} has only {val.tokens} tokens, fewer than train.seq_len+1="
               f"{seq_len + 1}; raise data.val_fraction, use more data or a shorter seq_len")
        raise ConfigError("data.val_fraction", val_fraction, fix)
    return train, val
