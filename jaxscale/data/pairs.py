"""Preference pairs: records of a prompt with a chosen and a rejected completion, as row pairs.

A record is {"prompt", "chosen", "rejected"} (TRL's preference format): three strings, each
completion joined to the prompt as it is and ended by the tokenizer's EOS, or a list of messages
for the prompt and a list of (assistant) messages for each completion, rendered as one
conversation by the chat template (jaxscale.data.chat). Each completion becomes one row of
seq_len+1 tokens, prompt first, the completion's tokens (its EOS included) marked trained, the
rest of the row filled with EOS and untrained. A row too long loses the prompt's first tokens,
then the completion's last ones. A pair is one sample: the data order shuffles pairs, and a
batch holds pair i as its rows 2i (chosen) and 2i+1 (rejected) (jaxscale.preference).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxscale.data import chat, formats
from jaxscale.data.tokenize import Tokenizer
from jaxscale.data.windows import example
from jaxscale.errors import ConfigError

KEYS = ("prompt", "chosen", "rejected")


def is_pairs(path: Path) -> bool:
    """Whether `path` holds preference records: a record format whose first record has a prompt,
    a chosen and a rejected completion."""
    if formats.kind_of(path) not in formats.RECORD_KINDS:
        return False
    first = next(formats.records(path), None)
    return first is not None and set(KEYS) <= set(first[0])


def _row(record: dict, answer: str, template: chat.Template | None, tokenizer: Tokenizer, width: int,
         where: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of the prompt and one completion, `width` long."""
    joined = {"prompt": record["prompt"], "completion": record[answer]}
    tokens, mask = chat.tokenized(*chat.spans(joined, template, "assistant", where), tokenizer)
    prompt = mask.index(1) if 1 in mask else len(mask)
    start = min(max(len(tokens) - width, 0), max(prompt - 1, 0))  # the prompt's start goes first
    tokens, mask = tokens[start:start + width], mask[start:start + width]
    pad = width - len(tokens)
    return np.asarray(tokens + [tokenizer.eos_id] * pad, np.int32), np.asarray(mask + [0] * pad, np.int32)


def encode(path: Path, template: chat.Template | None, tokenizer: Tokenizer,
           seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of every record of `path`: int32 [pairs, 2, seq_len + 1], row 0 the chosen
    completion, row 1 the rejected one."""
    rows = []
    for record, where in formats.records(path):
        missing = [key for key in KEYS if key not in record]
        if missing:
            raise ConfigError(formats.PATH, where, f"has no {', '.join(missing)}; a preference record has "
                              "prompt, chosen and rejected")
        rows.append([_row(record, answer, template, tokenizer, seq_len + 1, where) for answer in KEYS[1:]])
    tokens = np.asarray([[r[0] for r in pair] for pair in rows], np.int32)
    return tokens, np.asarray([[r[1] for r in pair] for pair in rows], np.int32)


class PairWindows(Sequence):
    """Random access to the pairs: pair -> its two rows' example (see windows.example), each array
    [2, seq_len]."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, eos_id: int | None):
        self._tokens, self._mask, self.eos_id = tokens, mask, eos_id
        self.tokens = int(tokens.size)

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index %= len(self)
        rows = [example(self._tokens[index, r], self.eos_id, self._mask[index, r]) for r in range(2)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


class Rows(Sequence):
    """The rows of a sequence of pairs in order: sample 2i is pair i's chosen row, 2i+1 its rejected."""

    def __init__(self, pairs: Sequence):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)  # pairs are endless (repeated): as many rows as Python counts

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        pair = self.pairs[index // 2]
        return {key: value[index % 2] for key, value in pair.items()}


def split(tokens: np.ndarray, mask: np.ndarray, val_fraction: float,
          eos_id: int | None) -> tuple[PairWindows, PairWindows]:
    """(training pairs, validation pairs: the last val_fraction of them, at least one)."""
    held = max(1, int(len(tokens) * val_fraction))
    if len(tokens) - held < 1:
        raise ConfigError("data.path", f"{len(tokens)} pairs", "preference data needs at least 2 pairs "
                          "(one held out for validation)")
    return PairWindows(tokens[:-held], mask[:-held], eos_id), PairWindows(tokens[-held:], mask[-held:], eos_id)
