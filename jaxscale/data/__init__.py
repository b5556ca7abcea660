"""Data: sources, tokenizers, packing and global batch assembly (Grain underneath).

    data = make_data(config, batch_sharding)
    for batch in data.train_batches(start_step): ...   # {'inputs','targets'}: int32 [B, L] jax.Arrays
"""

from jaxscale.data.batches import process_rows
from jaxscale.data.loader import Data, make_data
from jaxscale.data.tokenize import Tokenizer, load_tokenizer

__all__ = ["Data", "Tokenizer", "load_tokenizer", "make_data", "process_rows"]
