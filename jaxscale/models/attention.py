"""Attention kernels per platform, and where each token sits (`Placement`).

- `xla`, everywhere: the blockwise attention of `kernels.flash` (plain JAX, its own backward,
  memory O(L·d)); context parallelism builds its ring on it.
- `cudnn`, NVIDIA GPUs with bfloat16/float16 compute: cuDNN's fused flash attention.
- `splash`, TPUs, sequence lengths a multiple of 128: the Pallas splash attention kernel that
  ships with JAX (`kernels.splash`), segment ids included.
- `auto` (default): cudnn or splash where it can run, else xla.
With document masking (segment ids) cuDNN is not used: its packed-sequence form (offsets and
lengths per document) is not wired, and it could not be tested without a GPU. Nor with
soft-capped logits (Gemma 2's), which cuDNN cannot do; a sliding window (Gemma 2/3's local
layers) every kernel takes. Under context parallelism (`sequence` > 1) every platform runs the
ring or all-gather of `parallel.context`. Multi-head latent attention (models.latent), whose
value heads are narrower than its query and key heads, runs cuDNN's kernel with its values
widened by zeros to the keys' width (the output's extra columns are zeros, dropped), and the
blockwise kernel where cuDNN cannot run; never splash.
Decoding attends to a KV cache (`write_cache`, `cached_attention`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError
from jaxscale.kernels import flash, splash
from jaxscale.parallel import per_device

# The name of every attention kernel's saved residuals (its inputs, output and log-sum-exp), for
# remat policies: `model.remat=dots_saveable` keeps them, so no attention forward runs again in
# the backward pass.
KEPT = "attention_residuals"


class Placement(NamedTuple):
    """Where each token of a [B, L] batch sits: its position (what RoPE and learned position
    embeddings read, and what causality compares) and, with document masking, its document's
    id (None: each row one document); in a training step with LoRA dropout, each token's uint32
    dropout seed (models.lora; None: no dropout). A pytree, so it travels through scans, pipeline
    stages and shard_map as the token arrays do."""

    positions: jax.Array
    segments: jax.Array | None = None
    seeds: jax.Array | None = None

    def at_layer(self, index) -> Placement:
        """This placement as layer `index` (counted from the model's first, traced or not) sees
        it: the seeds moved along by the layer's index, so each layer draws its own dropout and
        a layer draws the same wherever it runs (a scan, a pipeline stage, a layout). Unchanged
        without seeds, or for index None (layer_indices' without seeds)."""
        if self.seeds is None or index is None:
            return self
        return self._replace(seeds=self.seeds + jnp.asarray(index, jnp.uint32) * LAYER_STRIDE)


LAYER_STRIDE = np.uint32(0x9E3779B9)  # odd: layers 0..2^32-1 move a seed to distinct values


def layer_indices(places: Placement, count: int, step: int = 1):
    """What a scan over `count` layers (or groups of `step` layers) passes each iteration for
    Placement.at_layer: its first layer's index, uint32 [count]; None without dropout seeds, so
    a scan without them carries nothing more."""
    return None if places.seeds is None else jnp.arange(0, count * step, step, dtype=jnp.uint32)


def document_positions(segments_BL):
    """Each token's position within its document: 0 where the segment id changes (and at the
    row's start), counting up until the next change."""
    index = jnp.broadcast_to(jnp.arange(segments_BL.shape[1], dtype=jnp.int32), segments_BL.shape)
    changed = jnp.concatenate([jnp.ones_like(segments_BL[:, :1], bool), segments_BL[:, 1:] != segments_BL[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(changed, index, 0), axis=1)


def cudnn_supported(platform: str, dtype, head_dim: int) -> str | None:
    """None if cuDNN flash attention can run this, else the reason it cannot."""
    if platform != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU (platform is {platform})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention needs bfloat16 or float16 compute (model.dtype resolves to {jnp.dtype(dtype).name})"
    if head_dim % 8 or head_dim > 256:
        return f"cuDNN attention needs a head dimension that is a multiple of 8 and at most 256 (got {head_dim})"
    return None


SOFTCAP = "cuDNN attention cannot soft-cap attention logits (model.attn_logit_softcap)"


LATENT = ("splash attention takes value heads as wide as the keys'; multi-head latent attention (model.mla) "
          "runs the blockwise kernel on TPUs")


def _unsupported(impl: str, platform: str, dtype, head_dim: int, document_mask: bool, length: int,
                 softcap: float, latent: bool = False) -> str | None:
    """None if kernel `impl` (cudnn or splash) can run this, else the reason it cannot; with
    latent attention `head_dim` is the query's and key's width."""
    if impl == "splash" and latent:
        return LATENT
    if impl == "splash":
        return f"splash attention needs a TPU (platform is {platform})" if platform != "tpu" else (
            splash.unsupported(length))
    reason = cudnn_supported(platform, dtype, head_dim)
    if reason is None and document_mask:
        reason = "cuDNN attention is not used with data.document_mask (segment ids); the blockwise kernel is"
    if reason is None and softcap:
        reason = SOFTCAP
    return reason


DETERMINISTIC = ("cuDNN attention is not deterministic with XLA's deterministic GPU ops (the step dies in "
                 "execute_sharded); train.deterministic uses the blockwise kernel")


def resolve_impl(requested: str, platform: str, dtype, head_dim: int, document_mask: bool = False,
                 length: int = 0, deterministic: bool = False, softcap: float = 0.0,
                 latent: bool = False) -> tuple[str, str | None]:
    """(the kernel to use, a one-line note or None). `auto` takes the platform's kernel (splash
    on TPU, cuDNN elsewhere) where it can run; with `deterministic` or logits soft-capped
    (softcap > 0) never cuDNN's; with latent attention (`latent`, `head_dim` the query's and
    key's width) never splash."""
    if requested == "xla":
        return "xla", None
    kernel = requested if requested != "auto" else "splash" if platform == "tpu" else "cudnn"
    reason = _unsupported(kernel, platform, dtype, head_dim, document_mask, length, softcap, latent)
    if reason is None and kernel == "cudnn" and deterministic:
        if requested == "cudnn":
            raise ConfigError("model.attention.impl", requested, DETERMINISTIC.replace(" uses", " needs") +
                              ": set model.attention.impl=xla or auto")
        return "xla", f"attention: xla ({DETERMINISTIC})"
    if reason is None:
        name = "cudnn flash attention" if kernel == "cudnn" else "splash attention (Pallas)"
        return kernel, f"attention: {name} (model.attention.impl={requested})"
    if requested != "auto":
        return "xla", f"warning: model.attention.impl={requested} falls back to xla: {reason}"
    return "xla", f"attention: xla ({reason})"


def kept(kernel):
    """kernel(*args), its output and residuals named KEPT: under a remat policy that saves them the
    backward pass takes them from the forward instead of running the kernel's forward again (a
    kernel's residuals are invisible to policies otherwise: its forward ran again in the layer's
    remat under dots_saveable)."""
    @jax.custom_vjp
    def run(*args):
        return kernel(*args)

    def forward(*args):  # the output too: the output projection's weight gradient reads it
        out, pullback = jax.vjp(kernel, *args)
        return checkpoint_name(out, KEPT), jax.tree.map(lambda r: checkpoint_name(r, KEPT), pullback)

    def backward(pullback, g):
        return pullback(g)

    run.defvjp(forward, backward)
    return run


def _cudnn(window: int):
    """cuDNN's fused attention, causal, to the `window` most recent keys when window > 0."""
    local = (window - 1, 0) if window else None
    return widened(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                                                implementation="cudnn"))


def widened(kernel):
    """kernel(q, k, v) for values narrower than the keys (latent attention's): v padded with
    zero columns to k's width, the same columns of the output (zeros) dropped; kernels whose
    values must be as wide as their keys compute the same attention this way."""
    def run(q, k, v):
        pad = k.shape[-1] - v.shape[-1]
        if pad <= 0:
            return kernel(q, k, v)
        wide = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
        return kernel(q, k, wide)[..., :v.shape[-1]]
    return run


def self_attention(q_BLHE, k_BLKE, v_BLKE, places: Placement, impl: str, block: int = flash.BLOCK, layout=None,
                   window: int = 0, softcap: float = 0.0):
    """Causal grouped-query attention on one device's whole sequence, within documents when
    places.segments is set (cudnn only without), to the `window` most recent positions (0: all)
    and with scores soft-capped at `softcap` (0: not; never cudnn, see resolve_impl). Given the
    run's layout, the xla and splash kernels run on each device's own rows and heads
    (`parallel.per_device`). The kernel's residuals are `kept` for remat policies."""
    if impl == "cudnn":
        return kept(_cudnn(window))(q_BLHE, k_BLKE, v_BLKE)
    pos, seg = places.positions, places.segments
    rows = (pos,) if seg is None else (pos, seg)
    if impl == "splash" and splash.unsupported(q_BLHE.shape[1]) is None:
        def on_tpu(q, k, v, _, seg=None):
            return splash.attention(q, k, v, seg, block, window=window, softcap=softcap)
        return kept(lambda *a: per_device(on_tpu, layout, *a, every_axis=True))(q_BLHE, k_BLKE, v_BLKE, *rows)

    def blockwise(q, k, v, pos, seg=None):
        return flash.attention(q, k, v, pos, pos, seg, seg, block, window, softcap)
    return kept(lambda *a: per_device(blockwise, layout, *a))(q_BLHE, k_BLKE, v_BLKE, *rows)


def write_cache(cache_BSKE, new_BLKE, positions_BL):
    """The cache with each row's new keys (or values, or latents: [B, S, ...] of any rank)
    written at its positions, which must be consecutive: row b's L entries land in slots
    positions_BL[b, 0] .. positions_BL[b, 0] + L - 1."""
    def row(cache_SKE, new_LKE, start):
        at = (start,) + (0,) * (cache_SKE.ndim - 1)
        return jax.lax.dynamic_update_slice(cache_SKE, new_LKE.astype(cache_SKE.dtype), at)

    return jax.vmap(row)(cache_BSKE, new_BLKE, positions_BL[:, 0])


def cached_attention(q_BLHE, k_BSKE, v_BSKE, positions_BL, window: int = 0, softcap: float = 0.0):
    """Grouped-query attention of new queries to a KV cache whose slot s holds position s: each
    query sees the slots at positions <= its own and (window > 0) fewer than `window` back, with
    scores soft-capped at `softcap` (0: not) as in `flash`. A plain masked softmax, scores and
    softmax in float32 and the weighted sum in the compute dtype, as the XLA kernel of
    causal_attention."""
    slots_BS = jnp.broadcast_to(jnp.arange(k_BSKE.shape[1]), (q_BLHE.shape[0], k_BSKE.shape[1]))
    return _attend_to(q_BLHE, k_BSKE, v_BSKE, positions_BL, slots_BS, window, softcap)


def _attend_to(q_BLHE, k_BSKE, v_BSKE, positions_BL, key_positions_BS, window: int, softcap: float):
    """The queries at positions_BL attending to keys at key_positions_BS (negative: an empty
    slot, never seen): the masked softmax of `cached_attention`."""
    B, L, H, E = q_BLHE.shape
    K = k_BSKE.shape[2]
    q_BLKGE = q_BLHE.reshape(B, L, K, H // K, E)
    s_BKGLS = jnp.einsum("BLKGE,BSKE->BKGLS", q_BLKGE, k_BSKE, preferred_element_type=jnp.float32) * E ** -0.5
    s_BKGLS = flash.soft_cap(s_BKGLS, softcap)
    back_BLS = positions_BL[:, :, None] - key_positions_BS[:, None, :]
    visible_BLS = (back_BLS >= 0) & (key_positions_BS[:, None, :] >= 0)
    visible_BLS = visible_BLS & (back_BLS < window) if window else visible_BLS
    s_BKGLS = jnp.where(visible_BLS[:, None, None], s_BKGLS, -jnp.inf)  # each query's own key is visible
    p_BKGLS = jax.nn.softmax(s_BKGLS, axis=-1).astype(v_BSKE.dtype)
    return jnp.einsum("BKGLS,BSKE->BLKGE", p_BKGLS, v_BSKE).reshape(B, L, H, v_BSKE.shape[-1])


def ring_slots(first_BL, slots: int):
    """The position each slot of a ring of `slots` holds before a row's new tokens from position
    first_BL[b] on are written (slot s: the last position before them that is s mod `slots`;
    negative where none is)."""
    last_B1 = first_BL[:, :1] - 1
    return last_B1 - jnp.mod(last_B1 - jnp.arange(slots), slots)


def ring_attention(q_BLHE, k_BLKE, v_BLKE, cache: dict, positions_BL, window: int, softcap: float = 0.0):
    """(out_BLHE, the updated cache) of a sliding-window layer whose cache ({'k', 'v'}: [B, W', K,
    E], W' = min(window, the cache's length)) is a ring: position t in slot t mod W'. The new
    tokens (consecutive positions) attend to the ring as it was and to each other, within the
    window; then the last W' of them are written over the slots they take."""
    slots = cache["k"].shape[1]
    keys_BS = jnp.concatenate([ring_slots(positions_BL, slots), positions_BL], axis=1)
    k_all, v_all = (jnp.concatenate([cache[n], new.astype(cache[n].dtype)], axis=1)
                    for n, new in (("k", k_BLKE), ("v", v_BLKE)))
    out_BLHE = _attend_to(q_BLHE, k_all, v_all, positions_BL, keys_BS, window, softcap)
    kept = min(slots, positions_BL.shape[1])  # distinct slots: the last W' tokens only

    def write(ring_SKE, new_LKE, positions_L):
        return ring_SKE.at[jnp.mod(positions_L[-kept:], slots)].set(new_LKE[-kept:].astype(ring_SKE.dtype))

    return out_BLHE, {n: jax.vmap(write)(cache[n], new, positions_BL) for n, new in (("k", k_BLKE), ("v", v_BLKE))}
