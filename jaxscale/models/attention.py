"""Attention kernels per platform: `xla` everywhere, cuDNN flash attention on NVIDIA GPUs; and
attention to a KV cache for decoding (`write_cache`, `cached_attention`)."""

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


def write_cache(cache_BSKE, new_BLKE, positions_BL):
    """The cache with each row's new keys (or values) written at its positions, which must be
    consecutive: row b's L entries land in slots positions_BL[b, 0] .. positions_BL[b, 0] + L - 1."""
    def row(cache_SKE, new_LKE, start):
        return jax.lax.dynamic_update_slice(cache_SKE, new_LKE.astype(cache_SKE.dtype), (start, 0, 0))

    return jax.vmap(row)(cache_BSKE, new_BLKE, positions_BL[:, 0])


def cached_attention(q_BLHE, k_BSKE, v_BSKE, positions_BL):
    """Grouped-query attention of new queries to a KV cache whose slot s holds position s: each
    query sees the slots at positions <= its own. A plain masked softmax, scores and softmax in
    float32 and the weighted sum in the compute dtype, as the XLA kernel of causal_attention."""
    B, L, H, E = q_BLHE.shape
    S, K = k_BSKE.shape[1], k_BSKE.shape[2]
    q_BLKGE = q_BLHE.reshape(B, L, K, H // K, E)
    s_BKGLS = jnp.einsum("BLKGE,BSKE->BKGLS", q_BLKGE, k_BSKE, preferred_element_type=jnp.float32) * E ** -0.5
    visible_BLS = jnp.arange(S) <= positions_BL[:, :, None]
    s_BKGLS = jnp.where(visible_BLS[:, None, None], s_BKGLS, -jnp.inf)  # slot 0 is always visible
    p_BKGLS = jax.nn.softmax(s_BKGLS, axis=-1).astype(v_BSKE.dtype)
    return jnp.einsum("BKGLS,BSKE->BLKGE", p_BKGLS, v_BSKE).reshape(B, L, H, E)
