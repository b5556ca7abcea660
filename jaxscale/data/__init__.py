"""Data: sources, token stores, tokenizers, mixtures, packing and global batch assembly (Grain underneath).

    data = make_data(config, batch_sharding)
    for batch in data.train_batches(start_step): ...   # {'inputs','targets'}: int32 [B, L] jax.Arrays

Names are imported on first use, so `python -m jaxscale.prepare` and its worker processes, which
read and tokenize text, never load JAX.
"""

import importlib

_HOMES = {"Data": "loader", "make_data": "loader", "process_rows": "batches",
          "Tokenizer": "tokenize", "load_tokenizer": "tokenize"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'jaxscale.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxscale.data.{_HOMES[name]}"), name)
