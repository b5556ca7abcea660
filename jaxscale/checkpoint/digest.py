"""Per-array digests that prove a restored array holds exactly the bytes that were saved.

Orbax stores arrays zstd-compressed without a checksum, so a flipped byte on disk can restore
silently as wrong numbers. Each array's digest is two position-weighted sums of its 32-bit
words, mod 2^32, computed on the devices where the array lives. Integer addition mod 2^32 is
exact and order-free, so the digest is the same on any mesh, device count or process count:
a checkpoint saved on one layout is verified after restoring onto another. Every single-bit
error changes the first sum (its weights are odd), and the index weighting catches swapped
positions.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.offload import DEVICE, HOST
from jaxscale.sharding import add_axis

_GOLDEN = np.uint32(0x9E3779B1)
_MIX = np.uint32(0x85EBCA6B)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (one per element; two for 8-byte types)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major element index, built from iotas so a sharded array is never reshaped."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def array_digest(x: jax.Array) -> jax.Array:
    """uint32[2], mod 2^32: the words weighted by (2i+1), summed; and each word mixed with its
    index (a murmur-style multiply and shift), summed."""
    words = _words(x)
    index = _flat_index(words.shape)
    first = jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)
    mixed = (words ^ (index * _GOLDEN)) * _MIX
    second = jnp.sum(mixed ^ (mixed >> 13), dtype=jnp.uint32)
    return jnp.stack([first, second])


def _spread(x) -> NamedSharding | None:
    """A device-memory sharding that splits `x` over the mesh axes it is replicated on too, where
    a dimension allows: every device then digests a different part (slicing a replica needs no
    communication) instead of all repeating the same work. None: leave it as it is."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    for axis in sharding.mesh.axis_names:
        spec = add_axis(spec, x.shape, axis, sharding.mesh)
    on_host = sharding.memory_kind == HOST  # offloaded: digested on the devices
    return None if spec == sharding.spec and not on_host else NamedSharding(sharding.mesh, spec, memory_kind=DEVICE)


@functools.lru_cache(maxsize=16)
def _digest_fn(spread: tuple, out_sharding):
    def leaf_digests(leaves):
        return [array_digest(x if s is None else jax.device_put(x, s)) for x, s in zip(leaves, spread)]
    return jax.jit(leaf_digests, out_shardings=out_sharding)


class PendingDigests(dict):
    """{array path: digest} whose values arrive later: `provide` hands over the dispatched
    device computation (or an error); reading the mapping (items, values, [], get) waits for it.

    Orbax encodes a save's JSON items in its background commit thread, so a save can carry this
    mapping while the loop goes on: the computation is dispatched after Orbax has copied the
    arrays off the devices (dispatched before, it would queue ahead of those copies). The keys
    are filled in at once: CPython's JSON encoder writes an empty dict as {} without asking for
    its items.
    """

    def __init__(self, paths: list[str]):
        super().__init__(dict.fromkeys(paths, ""))
        self._ready, self._values, self._error = threading.Event(), None, None

    def provide(self, values=None, error: BaseException | None = None) -> None:
        self._values, self._error = values, error
        self._ready.set()

    def _resolve(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError("the checkpoint's digests were not computed") from self._error
        if self._values is not None:
            values, self._values = jax.device_get(self._values), None
            super().update({path: f"{int(v[0]):08x}{int(v[1]):08x}" for path, v in zip(self.keys(), values)})

    def items(self):
        self._resolve()
        return super().items()

    def values(self):
        self._resolve()
        return super().values()

    def __getitem__(self, path):
        self._resolve()
        return super().__getitem__(path)

    def get(self, path, default=None):
        self._resolve()
        return super().get(path, default)


def pending(tree) -> PendingDigests:
    """An unfilled mapping for the arrays of `tree` (see dispatch)."""
    return PendingDigests([jax.tree_util.keystr(path, simple=True, separator="/")
                           for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]])


def dispatch(tree):
    """Start computing the digests of every array of a (sharded) pytree on its devices; returns
    the (not yet computed) values. Collective when the arrays span several processes, so every
    process must call it at the same point."""
    leaves = jax.tree.leaves(tree)
    meshes = [leaf.sharding.mesh for leaf in leaves if isinstance(getattr(leaf, "sharding", None), NamedSharding)]
    out = NamedSharding(meshes[0], P()) if meshes else None  # replicated: every process can read it
    return _digest_fn(tuple(_spread(leaf) for leaf in leaves), out)(leaves)


def digests(tree) -> dict[str, str]:
    """{array path: 16 hex digits} for every array of a pytree, computed now."""
    mapping = pending(tree)
    mapping.provide(dispatch(tree))
    return dict(mapping.items())


def mismatches(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """Paths whose restored digest differs from the saved one (missing counts as different)."""
    return sorted(path for path, value in saved.items() if restored.get(path) != value)
