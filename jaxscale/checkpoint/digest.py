"""Per-array digests that prove a restored array holds exactly the bytes that were saved.

Orbax stores arrays zstd-compressed without a checksum, so a flipped byte on disk can restore
silently as wrong numbers. Each array's digest is two position-weighted sums of its 32-bit
words, mod 2^32, computed on the devices where the array lives. Integer addition mod 2^32 is
exact and order-free, so the digest is the same on any mesh, device count or process count:
a checkpoint saved on one layout is verified after restoring onto another. Every single-bit
error changes the first sum (its weights are odd), and the index weighting catches swapped
positions.

The program that computes them is compiled once per process and tree signature (shapes, dtypes,
shardings). `Digester` keeps that compile off a training loop's path: see its docstring.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
        """Hand over the values (or the error); only the first call counts."""
        if not self._ready.is_set():
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


def _program(leaves):
    """The jitted digest program for arrays (or ShapeDtypeStructs) like `leaves`."""
    meshes = [leaf.sharding.mesh for leaf in leaves if isinstance(getattr(leaf, "sharding", None), NamedSharding)]
    out = NamedSharding(meshes[0], P()) if meshes else None  # replicated: every process can read it
    return _digest_fn(tuple(_spread(leaf) for leaf in leaves), out)


def dispatch(tree):
    """Start computing the digests of every array of a (sharded) pytree on its devices; returns
    the (not yet computed) values. Collective when the arrays span several processes, so every
    process must call it at the same point. Compiles the program first unless it already is."""
    leaves = jax.tree.leaves(tree)
    values = _program(leaves)(leaves)
    _COMPILED.setdefault(_signature(leaves), _done())
    return values


def digests(tree) -> dict[str, str]:
    """{array path: 16 hex digits} for every array of a pytree, computed now."""
    mapping = pending(tree)
    mapping.provide(dispatch(tree))
    return dict(mapping.items())


def mismatches(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """Paths whose restored digest differs from the saved one (missing counts as different)."""
    return sorted(path for path, value in saved.items() if restored.get(path) != value)


# -- compiling off the caller's path ------------------------------------------------------------

# Up to this many bytes per device, a second copy of a state is cheap, and the digest program's
# compile (2-4 s for a TrainState on a 2-core CPU) would be most of what its first save blocks for;
# above it, copying the state is the larger part of a save, and a second copy might not fit.
COPY_LIMIT_BYTES = 256 * 2**20
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxscale-digest-compile")
_COMPILED: dict[tuple, concurrent.futures.Future] = {}  # tree signature -> its compile, done or running


def _signature(leaves) -> tuple:
    return tuple((x.shape, x.dtype, getattr(x, "weak_type", False), getattr(x, "sharding", None)) for x in leaves)


def _done() -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(None)
    return future


def _compiled(leaves) -> bool:
    future = _COMPILED.get(_signature(leaves))
    return future is not None and future.done()


def _may_copy(leaves) -> bool:
    """Whether the digests of these arrays may be dispatched later, on a copy: one process (no
    other must dispatch at the same point), device arrays only, and a cheap copy (an upper bound
    of the bytes per device, offloaded arrays excluded, within COPY_LIMIT_BYTES)."""
    if jax.process_count() > 1 or not all(isinstance(x, jax.Array) for x in leaves):
        return False
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves
                     if x.sharding.memory_kind != HOST)
    return per_device <= COPY_LIMIT_BYTES


def _compile(leaves) -> concurrent.futures.Future:
    """The compile of the program `dispatch` runs on arrays like `leaves`, started in a background
    thread unless it has run or is running. Once done, dispatching compiles nothing: JAX's caches
    hold the traced and compiled program."""
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type) for x in leaves]
    key = _signature(abstract)
    if key not in _COMPILED:
        _COMPILED[key] = _COMPILER.submit(lambda: _program(abstract).lower(abstract).compile())
    return _COMPILED[key]


@dataclasses.dataclass
class _Waiting:
    mapping: PendingDigests
    copies: list                      # the saved arrays, copied on their devices
    compiled: concurrent.futures.Future


class Digester:
    """Starts the digests of saved states without compiling on the caller's path.

    `start` dispatches at once when the program for the tree's signature (shapes, dtypes,
    shardings) is compiled, or when the digests cannot wait (see _may_copy: the program is then
    compiled first, as `dispatch` does). Otherwise it copies the arrays on their devices (no
    compile; the caller may donate the originals afterwards), compiles in a background thread,
    and dispatches on the copies at the first `poll` after the compile, or at `finish`. Device
    programs are launched from the caller's thread only: launched from two threads, programs
    could reach different devices in different orders and deadlock in their collectives. At
    most one state waits; `start` finishes the previous one first.
    """

    def __init__(self):
        self._waiting: _Waiting | None = None

    def start(self, tree, mapping: PendingDigests) -> None:
        self.finish()
        leaves = jax.tree.leaves(tree)
        if _compiled(leaves) or not _may_copy(leaves):
            mapping.provide(dispatch(leaves))
            return
        copies = jax.device_put(leaves, may_alias=False)  # a copy on the devices: nothing to compile
        self._waiting = _Waiting(mapping, copies, _compile(copies))

    def poll(self) -> None:
        """Dispatch the waiting state's digests if their program has compiled."""
        if self._waiting is not None and self._waiting.compiled.done():
            self.finish()

    def finish(self) -> None:
        """Dispatch the waiting state's digests now, after the compile if it still runs. A failed
        background compile is not raised here: the dispatch compiles again, and an error there
        goes to the mapping, so the save it belongs to fails."""
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        concurrent.futures.wait([waiting.compiled])
        try:
            waiting.mapping.provide(dispatch(waiting.copies))
        except BaseException as error:
            waiting.mapping.provide(error=error)
            if not isinstance(error, Exception):
                raise
