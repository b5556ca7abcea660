"""Looking at where a state lives: a table of every array's shape, PartitionSpec and bytes per
device, and a picture of how one array is split over the devices."""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding


def _spec(x) -> str:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return str(sharding.spec)
    return type(sharding).__name__ if sharding is not None else "-"


def _per_device_bytes(x) -> int:
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def sharding_table(tree, prefix: str = "") -> str:
    """One row per array: path, shape, dtype, PartitionSpec, MiB on each device."""
    rows = [(prefix + jax.tree_util.keystr(path, simple=True, separator="/"), "x".join(map(str, x.shape)) or "()",
             str(x.dtype), _spec(x), f"{_per_device_bytes(x) / 2**20:,.3f}")
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    header = ("array", "shape", "dtype", "PartitionSpec", "MiB/device")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header] + rows]
    return "\n".join(lines)


def show_sharding(x) -> None:
    """Draw which device holds which block of a 1-D or 2-D array (jax.debug.visualize_array_sharding)."""
    if x.ndim > 2:
        raise ValueError(f"can only draw 1-D or 2-D arrays; this one is {x.ndim}-D {x.shape}: index it first, "
                         "e.g. params['layers']['mlp']['w_up'][0]")
    jax.debug.visualize_array_sharding(x)
