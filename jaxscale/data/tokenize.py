"""Tokenizers: byte-level (built in), a Hugging Face tokenizer.json, or a tiktoken encoding.

Every tokenizer has `vocab_size`, `eos_id` (the document separator), `identity` (what a token
store records, so a store is read with the tokenizer that wrote it), `encode(str) -> list[int]`,
`decode(ids) -> str`, and `encode_batch(texts) -> list[np.ndarray]` (fast path for whole corpora).
The optional packages (tokenizers, tiktoken) are imported only when asked for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxscale.errors import ConfigError

FIELD = "data.tokenizer"
INSTALL = "pip install 'jaxscale[tokenizers]'"
# Tried in order: GPT-2/Llama-3 style, SentencePiece style, then a plain name.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What the data pipeline and the training loop need from a tokenizer."""

    vocab_size: int
    eos_id: int
    identity: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); id 0 (the NUL byte) separates documents."""

    vocab_size, eos_id, identity = 256, 0, "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # Ids >= 256 (e.g. a pre-tokenized file read with the default tokenizer) become 0xFF,
        # which is never valid UTF-8, so they show as U+FFFD instead of raising.
        raw = bytes(i if 0 <= i < 256 else 0xFF for i in map(int, ids))
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, read with the `tokenizers` package."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ConfigError(FIELD, path, f"a tokenizer.json needs the tokenizers package: {INSTALL}") \
                from None
        if not Path(path).is_file():
            raise ConfigError(FIELD, path, "no such file; use 'bytes', a tokenizer.json path or tiktoken:NAME")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as error:  # noqa: BLE001 -- the Rust side raises plain Exception
            fix = f"not a Hugging Face tokenizer.json ({error}); save one with Tokenizer.save"
            raise ConfigError(FIELD, path, fix) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = (self._tok.token_to_id(name) for name in EOS_NAMES)
        self.eos_id = next((i for i in ids if i is not None), 0)
        self.identity = f"tokenizer.json sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.21) skips offsets: about 2x faster on big texts.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


class TiktokenTokenizer:
    """A tiktoken encoding by name, e.g. tiktoken:gpt2 (its BPE file must be cached or downloadable)."""

    def __init__(self, name: str):
        spec = f"tiktoken:{name}"
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(FIELD, spec, f"tiktoken encodings need the tiktoken package: {INSTALL}") from None
        try:
            self._enc = tiktoken.get_encoding(name)
        except Exception as error:  # noqa: BLE001 -- unknown name, or no network for the BPE file
            fix = f"could not load the encoding ({error}); check the name or set TIKTOKEN_CACHE_DIR"
            raise ConfigError(FIELD, spec, fix) from None
        self.vocab_size, self.eos_id = self._enc.n_vocab, self._enc.eot_token
        self.identity = spec

    def encode(self, text: str) -> list[int]:
        # Ordinary: text that happens to spell "<|endoftext|>" is data, not a control token.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> Tokenizer:
    """'bytes' | a path to a tokenizer.json | 'tiktoken:NAME'; bad specs raise ConfigError(data.tokenizer)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1])
    return HFTokenizer(spec)
