"""Splitting a batch into microbatches and back, keeping every microbatch spread over the batch shards."""

from __future__ import annotations

import jax

from jaxscale import sharding
from jaxscale.errors import require


def check(config, sizes) -> None:
    """train.grad_accum_steps divides the global batch, and each microbatch divides evenly over
    the batch shards (the mesh axes the `batch` rule names); raises ConfigError naming the field."""
    t = config.train
    require(t.global_batch_size % t.grad_accum_steps == 0, "train.grad_accum_steps", t.grad_accum_steps,
            f"must divide train.global_batch_size={t.global_batch_size}")
    micro, (shards, axes) = t.global_batch_size // t.grad_accum_steps, sharding.batch_shards(config, sizes)
    require(micro % shards == 0, "train.global_batch_size", t.global_batch_size,
            f"each microbatch ({micro} = {t.global_batch_size}/{t.grad_accum_steps} accumulation steps) must "
            f"divide evenly over {shards} batch shards ({axes or 'one device'}); "
            f"use a multiple of {shards * t.grad_accum_steps}")


def split(x, count: int, unit: int = 1):
    """[B, ...] -> [count, B/count, ...], microbatch i = rows i, i+count, ... (with `unit` > 1,
    groups of `unit` consecutive rows taken whole: a preference batch's pairs stay together).

    Strided rows keep every microbatch spread evenly over the shards of the batch dimension,
    so no data moves between devices.
    """
    grouped = x.reshape(x.shape[0] // (count * unit), count, unit, *x.shape[1:]).swapaxes(0, 1)
    return grouped.reshape(count, x.shape[0] // count, *x.shape[1:])


def merge(x):
    """The inverse of split: [count, B/count, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def split_tree(tree, count: int, unit: int = 1):
    return jax.tree.map(lambda x: split(x, count, unit), tree)
