"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come out of a narrow latent.

Each token's hidden x [D] gives a latent c = norm(x w_kv_a) [C] (kv_lora_rank) and one rotary
key k_rope = RoPE(x w_k_rope) [R] shared by every head; c w_kv_b gives each head its
non-rotary key [N] and its value [V]. The query is x w_q, or through its own latent
norm(x w_q_a) w_q_b (q_lora_rank > 0), each head's [N + R]: a non-rotary part and a rotary part.
Scores are q . [k_nope, k_rope] over N + R dimensions.

Training expands the latent to per-head keys and values and runs the model's attention kernel
(`layers.causal`: blockwise, context parallel) on them. Decoding caches per token only
[c, k_rope] (C + R values) and attends in the absorbed form: the query's non-rotary part is
taken into the latent space through the key half of w_kv_b (q_nope w_uk^T), so the scores are
one product with the cached [c, k_rope], and the weighted sum of c goes through the value half
(w_uv) once per query, never per cached token. The same function, in another order of products.

The latent norms are RMSNorms with epsilon 1e-6, DeepSeek's whatever the model's norm_eps.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxscale.models import rope
from jaxscale.models.attention import Placement, cached_attention, write_cache
from jaxscale.models.families import head_size
from jaxscale.models.layers import Matmul, RMSNorm, causal, normal, output
from jaxscale.sharding import constrain

LATENT_EPS = 1e-6  # DeepSeek's latent norms (HF: q_a_layernorm, kv_a_layernorm), whatever rms_norm_eps says
CACHE = "latent"  # a latent layer's cache: {CACHE: [B, S, C + R]}, the normed latent then the rotated key
LATENT_ROWS = ("batch", "act_length", None)  # a latent [B, L, C]: whole on each device of its rows


@dataclasses.dataclass(frozen=True)
class LatentSpec:
    """config.model.mla: kv_lora_rank 0 is grouped-query attention (models.layers.Attention)."""

    kv_lora_rank: int = 0   # C: the keys' and values' latent width
    q_lora_rank: int = 0    # the queries' latent width; 0 = a full-rank query projection
    rope_head_dim: int = 64   # R: each head's rotary query and key part (the key's shared by the heads)
    nope_head_dim: int = 128  # N: each head's non-rotary query and key part
    v_head_dim: int = 128     # V: each head's value

    @property
    def on(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.nope_head_dim + self.rope_head_dim

    @property
    def cached(self) -> int:
        """Values a decoding cache holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.rope_head_dim


def widths(spec) -> tuple[int, int]:
    """(each head's query and key width, its value width) of a ModelSpec or a model config."""
    mla = spec.mla
    if mla.kv_lora_rank:
        return mla.nope_head_dim + mla.rope_head_dim, mla.v_head_dim
    return head_size(spec), head_size(spec)


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention (see the module's docstring), global layers only
    (models.checks), rotary positions as the layer's LayerKind says, scores scaled by
    cfg.query_scale ** -0.5 (0: (N + R) ** -0.5) and soft-capped at cfg.attn_logit_softcap."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        m, D, H = cfg.mla, cfg.d_model, cfg.num_heads
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        if m.q_lora_rank:
            self.wq_a = normal(rngs, (D, m.q_lora_rank), ("embed", "latent"), std)
            self.q_norm = RMSNorm(m.q_lora_rank, LATENT_EPS)
            self.wq_b = normal(rngs, (m.q_lora_rank, H, m.qk_head_dim), ("latent", "heads", "head_dim"), std)
        else:
            self.wq = normal(rngs, (D, H, m.qk_head_dim), ("embed", "heads", "head_dim"), std)
        self.wkv_a = normal(rngs, (D, m.kv_lora_rank), ("embed", "latent"), std)
        self.wk_rope = normal(rngs, (D, m.rope_head_dim), ("embed", "head_dim"), std)
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_EPS)
        self.wkv_b = normal(rngs, (m.kv_lora_rank, H, m.nope_head_dim + m.v_head_dim),
                            ("latent", "heads", "head_dim"), std)
        self.wo = normal(rngs, (H, m.v_head_dim, D), ("heads", "head_dim", "embed"), out_std)
        self.mla, self.cpu, self.matmul = m, cfg.cpu_matmul, Matmul.of(cfg)
        self.query_factor = (m.qk_head_dim / cfg.query_scale) ** 0.5 if cfg.query_scale else 1.0
        self.softcap, self.default_kind = cfg.attn_logit_softcap, cfg.layer_kinds[0]
        self.impl, self.block, self.strategy = cfg.attention_impl, cfg.attention_block, cfg.strategy

    def _heads(self, y, axes=("batch", "act_length", "act_heads", "head_dim")):
        """y placed as attention's heads (or by `axes`: LATENT_ROWS for a latent)."""
        return constrain(y, self.strategy.layout, axes)

    def _query(self, x_BLD, tables):
        """q [B, L, H, N + R]: the non-rotary part, then the rotary part rotated, times the query factor."""
        if hasattr(self, "wq_a"):
            q_BLQ = self.q_norm(self.matmul(x_BLD, self.wq_a[...], 1))
            q_BLHE = self.matmul(self._heads(q_BLQ, LATENT_ROWS), self.wq_b[...], 1)
        else:
            q_BLHE = self.matmul(x_BLD, self.wq[...], 1)
        q_BLHE = self._heads(q_BLHE)
        N = self.mla.nope_head_dim
        q_BLHE = jnp.concatenate([q_BLHE[..., :N], rope.rotate(q_BLHE[..., N:], tables)], axis=-1)
        return q_BLHE * jnp.asarray(self.query_factor, q_BLHE.dtype) if self.query_factor != 1.0 else q_BLHE

    def _latent(self, x_BLD, tables):
        """(the normed latent c [B, L, C], the rotated key [B, L, R])."""
        c_BLC = self.kv_norm(self.matmul(x_BLD, self.wkv_a[...], 1))
        k_BL1R = rope.rotate(self.matmul(x_BLD, self.wk_rope[...], 1)[:, :, None, :], tables)
        return c_BLC, k_BL1R[:, :, 0, :]

    def __call__(self, x_BLD, places: Placement, cache=None, kind=None):
        """(out_BLD, cache): as models.layers.Attention, the cache {CACHE: [B, S, C + R]}."""
        kind = self.default_kind if kind is None else kind
        tables = rope.tables(places.positions, self.mla.rope_head_dim, kind.rope_theta, kind.rope_scaling, self.cpu)
        q_BLHE = self._query(x_BLD, tables)
        c_BLC, k_BLR = self._latent(x_BLD, tables)
        if cache is not None:
            cache = {CACHE: write_cache(cache[CACHE], jnp.concatenate([c_BLC, k_BLR], -1), places.positions)}
            return self._decode(q_BLHE, cache[CACHE], places.positions), cache
        N, H = self.mla.nope_head_dim, q_BLHE.shape[2]
        kv_BLHE = self._heads(self.matmul(self._heads(c_BLC, LATENT_ROWS), self.wkv_b[...], 1))
        k_BLHR = jnp.broadcast_to(k_BLR[:, :, None, :], (*k_BLR.shape[:2], H, k_BLR.shape[-1]))
        k_BLHE = self._heads(jnp.concatenate([kv_BLHE[..., :N], k_BLHR.astype(kv_BLHE.dtype)], -1))
        out_BLHV = causal(q_BLHE, k_BLHE, self._heads(kv_BLHE[..., N:]), places, self, softcap=self.softcap)
        return output(self, out_BLHV), None

    def _decode(self, q_BLHE, cache_BSX, positions_BL):
        """The absorbed form against the cache [B, S, C + R]: one key and value head, the latent,
        that every query head attends to after its non-rotary part is taken into the latent's
        space; the scores' scale put back to (N + R) ** -0.5 (cached_attention scales by the
        width it sees, C + R)."""
        m = self.mla
        w_CHE = self.wkv_b[...].astype(q_BLHE.dtype)
        q_BLHC = jnp.einsum("BLHN,CHN->BLHC", q_BLHE[..., :m.nope_head_dim], w_CHE[..., :m.nope_head_dim])
        q_BLHX = jnp.concatenate([q_BLHC, q_BLHE[..., m.nope_head_dim:]], -1)
        q_BLHX = q_BLHX * jnp.asarray((m.cached / m.qk_head_dim) ** 0.5, q_BLHX.dtype)
        keys_BS1X = cache_BSX[:, :, None, :]
        out_BLHC = cached_attention(q_BLHX, keys_BS1X, keys_BS1X[..., :m.kv_lora_rank], positions_BL,
                                    softcap=self.softcap)
        out_BLHV = jnp.einsum("BLHC,CHV->BLHV", out_BLHC, w_CHE[..., m.nope_head_dim:])
        return output(self, out_BLHV)
