"""Splitting a batch into microbatches and back, keeping every microbatch spread over the batch shards."""

from __future__ import annotations

import jax


def split(x, count: int):
    """[B, ...] -> [count, B/count, ...], microbatch i = rows i, i+count, ...

    Strided rows keep every microbatch spread evenly over the shards of the batch dimension,
    so no data moves between devices.
    """
    return x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)


def merge(x):
    """The inverse of split: [count, B/count, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def split_tree(tree, count: int):
    return jax.tree.map(lambda x: split(x, count), tree)
