"""Attention kernels per platform: `xla` everywhere, cuDNN flash attention on NVIDIA GPUs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("xla", "cudnn", "auto")


def cudnn_supported(platform: str, dtype, head_dim: int) -> str | None:
    """None if cuDNN flash attention can run this, else the reason it cannot."""
    if platform != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU (platform is {platform})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention needs bfloat16 or float16 compute (model.dtype resolves to {jnp.dtype(dtype).name})"
    if head_dim % 8 or head_dim > 256:
        return f"cuDNN attention needs a head dimension that is a multiple of 8 and at most 256 (got {head_dim})"
    return None


def resolve_impl(requested: str, platform: str, dtype, head_dim: int) -> tuple[str, str | None]:
    """(the kernel to use, a one-line note or None). `auto` takes cuDNN where it can run."""
    reason = cudnn_supported(platform, dtype, head_dim)
    if requested == "xla":
        return "xla", None
    if reason is None:
        return "cudnn", f"attention: cudnn flash attention (model.attention.impl={requested})"
    if requested == "cudnn":
        return "xla", f"warning: model.attention.impl=cudnn falls back to xla: {reason}"
    return "xla", f"attention: xla ({reason})"


def causal_attention(q_BLHE, k_BLKE, v_BLKE, impl: str):
    """Causal grouped-query attention on one device's whole sequence."""
    return jax.nn.dot_product_attention(q_BLHE, k_BLKE, v_BLKE, is_causal=True, implementation=impl)
