"""Data: sources, tokenizers, packing and global batch assembly (Grain underneath)."""

from jaxscale.data.loader import Data, make_data, process_rows
from jaxscale.data.tokenize import load_tokenizer

__all__ = ["Data", "make_data", "process_rows", "load_tokenizer"]
