"""Decoding with a KV cache: the cache, one decoding call, and a layer that reads and writes its
slice of it (the layer loop, Transformer._loop, hands each layer its slice).

The cache is {'k', 'v'}, each [layers, batch, max_len, kv_heads, head_dim] in the compute
dtype; slot s holds position s. Decoding runs as one program on the model's default strategy
(LanguageModel.unsharded): no pipeline, no per-layer weight gathering, the weights cast to the
compute dtype where each layer runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.attention import Placement


def init_cache(spec, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty KV cache for `batch` sequences of up to `max_len` tokens of the model `spec` builds."""
    shape = (spec.num_layers, batch, max_len, spec.num_kv_heads, spec.head_size)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def decode(graphdef, params: dict, tokens_BL, positions_BL, cache: dict):
    """(logits_BLV float32, new cache) of the Transformer `graphdef` with `params`: see
    LanguageModel.decode."""
    return nnx.merge(graphdef, params)(tokens_BL, Placement(positions_BL), cache)[:2]


def layer(graphdef, params, x_BLD, places: Placement, cache: dict, dtype, kind=None):
    """One layer (a Block or an MoEBlock, of LayerKind `kind`) with its slice of the cache:
    (x_BLD, its updated cache, router statistics: {} for a dense layer)."""
    out = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))(x_BLD, places, cache, kind)
    return out if len(out) == 3 else (*out, {})

