"""Tokenizers: byte-level (built in), a Hugging Face tokenizer.json, or a tiktoken encoding."""

from __future__ import annotations

from pathlib import Path

from jaxscale.errors import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
FIELD = "data.tokenizer"


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); byte 0 separates documents."""

    vocab_size, eos_id = 256, 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json` (the `tokenizers` package)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(FIELD, path, "needs the tokenizers package: pip install 'jaxscale[tokenizers]'") from None
        if not Path(path).is_file():
            raise ConfigError(FIELD, path, "no such tokenizer.json file; use 'bytes', a tokenizer.json path or tiktoken:NAME")
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(name) for name in EOS_NAMES]
        self.eos_id = next((i for i in ids if i is not None), 0)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class TiktokenTokenizer:
    """A tiktoken encoding by name, e.g. tiktoken:gpt2 (its files must be cached or downloadable)."""

    def __init__(self, name: str):
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(FIELD, f"tiktoken:{name}", "needs tiktoken: pip install 'jaxscale[tokenizers]'") from None
        try:
            self._enc = tiktoken.get_encoding(name)
        except Exception as error:  # unknown name or no network for the BPE file
            raise ConfigError(FIELD, f"tiktoken:{name}", f"could not load the encoding ({error}); check the name or TIKTOKEN_CACHE_DIR") from None
        self.vocab_size, self.eos_id = self._enc.n_vocab, self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    """'bytes' | path/to/tokenizer.json | tiktoken:NAME."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1])
    return HFTokenizer(spec)
