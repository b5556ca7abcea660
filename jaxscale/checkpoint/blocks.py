"""A sharded array's blocks, and moving them between processes, for the local checkpoint layer
(checkpoint.local): each process keeps a replica of its predecessor's blocks beside its own, and
an array is put back together on any mesh from blocks held by whichever processes hold them.

A block is one distinct shard of an array, named by its place in the global shape as text
("0:4,0:128"), so that copies written by a job on one mesh are understood by a job on another.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def name(index: tuple, shape: tuple) -> str:
    """The block at `index` (a shard's tuple of slices) of an array of `shape`, as text."""
    return ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}" for s, n in zip(index, shape, strict=True))


def slices(block: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in block.split(",") if part)


@functools.lru_cache(maxsize=4096)
def all_of(sharding, shape: tuple) -> tuple[str, ...]:
    """Every distinct block of an array of `shape` laid out by `sharding` (the same at every save)."""
    return tuple(sorted({name(index, shape) for index in sharding.devices_indices_map(shape).values()}))


def held(array: jax.Array, source_of=None) -> dict[str, jax.Array]:
    """This process's distinct blocks of `array`, by name, each a single-device array whose copy
    to the host has started (`host_bits` waits for it). With `source_of` (a device -> device
    map), each device's shard is named as the block the source device held."""
    indices = array.sharding.devices_indices_map(array.shape)
    out = {}
    for shard in array.addressable_shards:
        block = name(indices[shard.device if source_of is None else source_of[shard.device]], array.shape)
        if block not in out:
            out[block] = shard.data
            out[block].copy_to_host_async()
    return out


def host_bits(block: jax.Array) -> np.ndarray:
    """A block on the host as unsigned bits of its dtype's width (so any dtype, bfloat16 too,
    saves and loads as plain numpy). As Orbax does, the host array may share the device buffer's
    memory on CPU: the runtime does not donate a buffer that such an array still references."""
    return np.asarray(block).view(bits(block.dtype))


@functools.lru_cache(maxsize=4096)
def replicated_on_every_process(sharding, shape: tuple) -> bool:
    """Whether each process holds every block itself (then a peer's replica adds nothing)."""
    by_process: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        by_process.setdefault(device.process_index, set()).add(name(index, shape))
    return len({frozenset(blocks) for blocks in by_process.values()}) == 1


def _ring(mesh: Mesh) -> list[tuple[int, int]]:
    """(from, to) mesh positions: each device sends to the device at the same local place on the
    next process (process order is a ring)."""
    flat = list(mesh.devices.flat)
    processes = sorted({d.process_index for d in flat})
    local = {p: [i for i, d in enumerate(flat) if d.process_index == p] for p in processes}
    return [pair for r, p in enumerate(processes)
            for pair in zip(local[p], local[processes[(r + 1) % len(processes)]], strict=True)]


def peer_sources(mesh: Mesh) -> dict:
    """device -> the device whose block it holds after `peer_copy`."""
    flat = list(mesh.devices.flat)
    return {flat[to]: flat[source] for source, to in _ring(mesh)}


@functools.lru_cache(maxsize=8)
def _peer_program(mesh: Mesh, specs: tuple):
    axes = tuple(mesh.axis_names)
    ring = _ring(mesh)

    def shift(*blocks):
        return tuple(jax.lax.ppermute(b, axes, ring) for b in blocks)

    return jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False))


def peer_copy(arrays: list, mesh: Mesh) -> list:
    """Each array with every device's shard replaced by the one its ring predecessor (the device
    at the same local place on the previous process) held: one collective permute, so each
    process ends up holding a replica of its predecessor's blocks (see `peer_sources`)."""
    return list(_peer_program(mesh, tuple(a.sharding.spec for a in arrays))(*arrays))


def bits(dtype) -> np.dtype:
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


@functools.lru_cache(maxsize=64)
def _sum_program(sharding, dtype):
    def total(stacked):
        summed = stacked.sum(0, dtype=stacked.dtype)
        return summed != 0 if np.dtype(dtype) == np.bool_ else jax.lax.bitcast_convert_type(summed, dtype)

    return jax.jit(total, out_shardings=sharding)


def assemble(target, owned: dict[str, np.ndarray]) -> jax.Array:
    """The array `target` (a ShapeDtypeStruct with its sharding) from the blocks (as `held` gives
    them) each process owns: every block must be owned by exactly one process. Each process lays its blocks into a
    zero array (as unsigned bits) on its first device; one summing program over all devices
    delivers each device its shard. Holds one whole array per device while it runs."""
    buffer = np.zeros(target.shape, bits(target.dtype))
    for block, values in owned.items():
        buffer[slices(block)] = values
    if jax.process_count() == 1:
        return jax.device_put(buffer.view(target.dtype), target.sharding)
    devices = list(target.sharding.mesh.devices.flat)
    first = {}
    for d in devices:
        first.setdefault(d.process_index, d)
    local = [d for d in devices if d.process_index == jax.process_index()]
    parts = [jax.device_put((buffer if d == first[d.process_index] else np.zeros_like(buffer))[None], d)
             for d in local]
    stacked = jax.make_array_from_single_device_arrays((len(devices), *target.shape),
                                                       NamedSharding(Mesh(np.array(devices), ("all",)), P("all")),
                                                       parts)
    # One at a time: independent collective programs in flight together may run in another order
    # on each process, and XLA:CPU's collectives then wait for each other forever (seen here).
    return jax.block_until_ready(_sum_program(target.sharding, jnp.dtype(target.dtype))(stacked))
