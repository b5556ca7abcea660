"""Stacked [layers, ...] parameters moved between host and device(s) one layer at a time.

Neither direction ever holds a whole stacked array on the host, and neither gathers one on
a device: writing updates a pre-allocated (sharded) array in place; reading copies only the
shards that hold the wanted layer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Donated: each layer is written into the same buffers, so the stack is allocated once.
_write_layer = jax.jit(lambda stacked, value, i: jax.lax.dynamic_update_index_in_dim(stacked, value, i, 0),
                       donate_argnums=0)
_take_layer = jax.jit(lambda shard, i: jax.lax.dynamic_index_in_dim(shard, i, 0, keepdims=False))


def layer_sharding(sharding):
    """The sharding of one layer of a stacked array placed by `sharding` (None: default device)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return sharding


def assemble(read_layer: Callable[[int], np.ndarray], shape: tuple[int, ...], sharding=None) -> jax.Array:
    """A float32 array of `shape` placed by `sharding`, whose layer i is read_layer(i) (host numpy)."""
    stacked = jnp.zeros(shape, jnp.float32, device=sharding)
    per_layer = layer_sharding(sharding)
    for i in range(shape[0]):
        # Each layer's transfer finishes before the next is read: otherwise the reads run ahead of
        # the device and hold several layers' host buffers at once.
        layer = jax.device_put(read_layer(i), per_layer).block_until_ready()
        stacked = _write_layer(stacked, layer, i)
    return stacked


def fetch(x, layer: int | None = None) -> np.ndarray:
    """x (or its layer `layer`) on the host as float32, copied from each shard holding part of it."""
    if not isinstance(x, jax.Array):
        return np.asarray(x if layer is None else x[layer], np.float32)
    if not x.is_fully_addressable:
        raise NotImplementedError("exporting arrays that span several processes is not supported; "
                                  "gather the parameters onto one process first")
    if layer is None:
        return np.asarray(x, np.float32)
    out = np.empty(x.shape[1:], np.float32)
    for shard in x.addressable_shards:
        layers = range(x.shape[0])[shard.index[0]]
        if shard.replica_id == 0 and layer in layers:  # one copy of each replicated piece
            out[shard.index[1:]] = np.asarray(_take_layer(shard.data, layer - layers.start))
    return out
