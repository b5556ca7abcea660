"""TPU: the Pallas splash attention kernel that ships with JAX
(jax.experimental.pallas.ops.tpu.splash_attention), behind the interface of `flash.attention`.

Splash attention is FlashAttention for the TPU's matrix units: tiles of queries and keys in VMEM,
an online softmax, its own backward (dK/dV and dQ kernels), tiles that a static mask hides
skipped, and segment ids for packed documents. Here the static mask is causal over the row's
indices (with a sliding window of W keys, splash's local mask reaching W - 1 back), which is what
`flash` computes by positions whenever tokens are in order (no context parallelism) and
positions restart per document (`models.attention.document_positions`): within one document,
index order is position order. Soft-capping of the logits is the kernel's own
(attn_logits_soft_cap), applied to the scaled scores before the mask as in `flash`.

A Pallas kernel is one program per device, which the SPMD partitioner cannot split: under a mesh
it runs inside shard_map (`parallel.per_device`), every device its own rows and heads. On a host
without a TPU it runs in Pallas's interpreter (`interpret=True`): slow, exact, what the tests
compare against reference attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

LANES = 128  # splash tiles are multiples of the TPU's 128 lanes


def unsupported(length: int) -> str | None:
    """None if the kernel can run a sequence of this length, else why not."""
    if length % LANES:
        return f"splash attention needs a sequence length that is a multiple of {LANES} (got {length})"
    return None


def _kernel(heads: int, length: int, block: int, interpret: bool, window: int = 0, softcap: float = 0.0):
    """The kernel for this shape, built where it is called: it holds the mask's block tables as
    arrays, which must belong to the trace that uses them (a cached kernel leaks tracers)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # Pallas: 0.5 s to import, so here

    shape = (length, length)
    mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else splash.CausalMask(shape)
    b = block
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=softcap or None, interpret=interpret)


def _segment_ids(seg_L):
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
    return SegmentIds(seg_L, seg_L)


def attention(q_BLHE, k_BLKE, v_BLKE, seg_BL=None, block: int = 512, interpret: bool = False, window: int = 0,
              softcap: float = 0.0):
    """Causal grouped-query attention (within documents when seg_BL is set; with window > 0, to
    the `window` most recent keys, itself included; logits soft-capped at softcap > 0) by the
    splash kernel, on the arrays this device holds (under a mesh, inside `parallel.per_device`),
    in tiles of the largest multiple of 128 up to `block` that divides the length."""
    L, E = q_BLHE.shape[1], q_BLHE.shape[3]
    tile = next(b for b in range(max(min(block, L), LANES) // LANES * LANES, 0, -LANES) if L % b == 0)
    kernel = _kernel(q_BLHE.shape[2], L, tile, interpret, window, softcap)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    q_BHLE = heads_first(q_BLHE * jnp.asarray(E ** -0.5, q_BLHE.dtype))  # splash does not scale
    k_BKLE, v_BKLE = heads_first(k_BLKE), heads_first(v_BLKE)
    if seg_BL is None:
        out_BHLE = jax.vmap(kernel)(q_BHLE, k_BKLE, v_BKLE)
    else:
        out_BHLE = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=_segment_ids(s)))(
            q_BHLE, k_BKLE, v_BKLE, seg_BL)
    return heads_first(out_BHLE)
