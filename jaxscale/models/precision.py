"""Compute precision: parameters stay float32; the forward and backward run in this dtype."""

from __future__ import annotations

import jax.numpy as jnp


def compute_dtype(name: str, platform: str) -> jnp.dtype:
    """'auto' means bfloat16 on GPU/TPU and float32 on CPU, where bf16 matmuls are slow;
    `platform` is the compile target ('cpu', 'gpu', 'tpu')."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)
