"""Model FLOPs utilisation (PaLM convention): FLOPs per token, and the peak of a device (from
jaxscale.analysis.hardware's table).
The writers of metrics (JSONL, TensorBoard, MLflow, W&B) live in jaxscale.tracking."""

from __future__ import annotations

import math

import jax

from jaxscale.analysis.hardware import PEAK_TFLOPS
from jaxscale.errors import require_non_negative
from jaxscale.models.latent import widths
from jaxscale.models.moe import expert_param_count

EMBEDDING_PARAMS = ("embed", "pos_embed")  # lookups: excluded from N (a tied head counts again)


def check(config) -> None:
    """The `metrics` settings are usable; raises ConfigError naming the field."""
    require_non_negative(config, ("metrics.peak_tflops",))


def peak_tflops(device_kind: str) -> float | None:
    """The table's dense bf16 peak for this device, or None (e.g. CPU)."""
    for pattern, tflops in PEAK_TFLOPS:
        if pattern.lower() in device_kind.lower():
            return tflops
    return None


def matmul_params(params, spec) -> int:
    """N in 6N: the parameters a token's matmuls use. The embedding tables are lookups and do not
    count; when the output head is tied to the token table, that table is a matmul there and counts
    once (vocab x d_model); a separate head counts as any other weight."""
    n = sum(math.prod(v.shape) for k, v in params.items() if k not in EMBEDDING_PARAMS
            for v in jax.tree.leaves(v))
    return n + (math.prod(params["embed"].shape) if spec.tie_embeddings else 0)


def active_params(params, spec) -> int:
    """N for a token: `matmul_params`, counting of the expert weights only the top_k of
    num_experts each token uses (the dense-equivalent N of an MoE model)."""
    n = matmul_params(params, spec)
    if not spec.moe.num_experts:
        return n
    experts = expert_param_count(params)
    return n - experts + experts * spec.moe.top_k // spec.moe.num_experts


def flops_per_token(spec, n_params: int, seq_len: int, frozen: int = 0, reference: bool = False) -> float:
    """Training FLOPs per token, PaLM (Chowdhery et al. 2022, app. B): 6N + 12·L·H·Q·T; with
    value heads of another width than the query's and key's (latent attention, models.latent)
    the scores' and the weighted sum's halves apart: 6·L·H·(Q + V)·T. `frozen` of the N are
    not trained (a LoRA base): their weight gradients are never computed, so they cost 4 (the
    forward and the input's gradient), not 6. With a `reference` model (DPO), each token also
    runs its forward pass: 2N + 2·L·H·(Q + V)·T more."""
    qk, v = widths(spec)
    attention = spec.num_layers * spec.num_heads * (qk + v) * seq_len
    return 6.0 * n_params - 2.0 * frozen + 6.0 * attention + (2.0 * n_params + 2.0 * attention if reference else 0.0)


def attention_recompute_flops_per_token(spec, seq_len: int) -> float:
    """The matmul FLOPs per token a step does beyond the convention's: the blockwise attention's
    backward recomputes each tile's scores Q·Kᵀ (2·L·H·Q·T), as FlashAttention does; MFU leaves
    recomputation out, so the compiled step's matmuls are flops_per_token plus this."""
    return 2.0 * spec.num_layers * spec.num_heads * widths(spec)[0] * seq_len


def mfu(tokens_per_sec: float, flops_per_tok: float, num_devices: int, peak: float | None) -> float | None:
    """Achieved model FLOP/s over the devices' summed peak; None where the peak is unknown."""
    if not peak:
        return None
    return tokens_per_sec * flops_per_tok / (num_devices * peak * 1e12)
