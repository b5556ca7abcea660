"""Decoding with a KV cache: the cache, one decoding call, and a layer that reads and writes its
slice of it (the layer loop, Transformer._loop, hands each layer its slice).

The cache holds a stack per kind of layer (`stack_of`), each {'k', 'v'}: [layers of that kind,
batch, slots, kv_heads, head_dim] in the compute dtype (multi-head latent attention's
{'latent': [layers, batch, slots, kv_lora_rank + rope_head_dim]}, models.latent). A global layer's slot s holds position
s (max_len slots); a sliding-window layer's cache is a ring of min(window, max_len) slots,
position t in slot t mod their number, so it holds its window and no more. Decoding runs as one
program on the model's default strategy (LanguageModel.unsharded): no pipeline, no per-layer
weight gathering, the weights cast to the compute dtype where each layer runs.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.attention import Placement
from jaxscale.models.latent import CACHE

GLOBAL, LOCAL = "global", "local"  # the cache's stacks: global layers', sliding-window layers'


def stack_of(kind) -> str:
    """Which of the cache's stacks holds the cache of a layer of this LayerKind."""
    return LOCAL if kind.window else GLOBAL


def init_cache(spec, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty KV cache for `batch` sequences of up to `max_len` tokens of the model `spec` builds:
    {stack: {'k', 'v'}}, a stack for each kind of layer the model has."""
    kinds = spec.layer_kinds
    layers = Counter(stack_of(kinds[i % len(kinds)]) for i in range(spec.num_layers))
    slots = {GLOBAL: max_len, LOCAL: min(spec.sliding_window, max_len)}
    if spec.mla.on:  # the latent and the rotary key of each token (models.latent)
        return {name: {CACHE: jnp.zeros((count, batch, slots[name], spec.mla.cached), dtype)}
                for name, count in layers.items()}
    return {name: {n: jnp.zeros((count, batch, slots[name], spec.num_kv_heads, spec.head_size), dtype)
                   for n in ("k", "v")} for name, count in layers.items()}


def decode(graphdef, params: dict, tokens_BL, positions_BL, cache: dict):
    """(logits_BLV float32, new cache) of the Transformer `graphdef` with `params`: see
    LanguageModel.decode."""
    return nnx.merge(graphdef, params)(tokens_BL, Placement(positions_BL), cache)[:2]


def layer(graphdef, params, x_BLD, places: Placement, cache: dict, dtype, kind=None):
    """One layer (a Block or an MoEBlock, of LayerKind `kind`) with its slice of the cache:
    (x_BLD, its updated cache, router statistics: {} for a dense layer)."""
    out = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))(x_BLD, places, cache, kind)
    return out if len(out) == 3 else (*out, {})

