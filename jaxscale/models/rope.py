"""Rotary position embedding: its frequencies, plain or scaled to extend the context a model was
pretrained on (Llama 3.1's `llama3`, linear interpolation, YaRN: the `rope_scaling` types of
Hugging Face checkpoints), and their application to q and k.

The scaled frequencies follow Hugging Face's definitions (transformers' modeling_rope_utils),
computed in float32 as there, so an imported checkpoint gives the logits it gives in transformers.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxscale.models.matmul import apart


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled (`model.rope_scaling`); type none: plain RoPE."""

    type: str = "none"                 # none | linear | llama3 | yarn (names.ROPE_SCALINGS)
    factor: float = 1.0                # how many times the pretrained context the model reaches
    original_max_seq_len: int = 8192   # llama3, yarn: the context the model was pretrained on
    low_freq_factor: float = 1.0       # llama3: wavelengths above original/low are divided by factor
    high_freq_factor: float = 4.0      # llama3: wavelengths below original/high are kept
    beta_fast: float = 32.0            # yarn: rotations below which a dimension is interpolated...
    beta_slow: float = 1.0             # ...and above which it is kept (a linear ramp between)
    attention_factor: float = 0.0      # yarn: sin and cos scaled by it; 0 = 0.1 ln(factor) + 1
    truncate: bool = True              # yarn: the ramp's ends rounded out to whole dimensions


def _plain(head_dim: int, theta: float) -> np.ndarray:
    return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))).astype(np.float32)


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between blended."""
    low_wavelen, high_wavelen = s.original_max_seq_len / s.low_freq_factor, s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * np.float32(math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def _yarn(inv: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: dimensions that turn fewer than beta_slow times over the pretrained context are
    interpolated (divided by `factor`), those turning more than beta_fast times kept, a ramp between."""
    def dimension(rotations):
        return head_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    kept = 1 - np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    return (inv / s.factor) * (1 - kept) + inv * kept  # HF's order of operations: the same float32 values


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """The [head_dim/2] float32 angular frequencies of the scaled rotary embedding."""
    inv = _plain(head_dim, theta)
    if scaling.type == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    if scaling.type == "llama3":
        return _llama3(inv, scaling).astype(np.float32)
    if scaling.type == "yarn":
        return _yarn(inv, head_dim, theta, scaling).astype(np.float32)
    return inv


def magnitude(scaling: RopeScaling) -> float:
    """What sin and cos are multiplied by: YaRN's attention factor, else 1."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def _sin_cos(angle_BLE, scale: float = 1.0):
    sin, cos = jnp.sin(angle_BLE)[:, :, None, :], jnp.cos(angle_BLE)[:, :, None, :]
    return (sin, cos) if scale == 1.0 else (sin * scale, cos * scale)


def tables(positions_BL, head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(), cpu: bool = False):
    """(sin, cos), [B, L, 1, E/2] float32, of rotary embedding at these positions, for q and k
    alike. With `cpu` they are made apart (`matmul.apart`): XLA:CPU would otherwise compute them
    again for every head, in the fusion that rotates and transposes q (3% of tiny.py's step)."""
    if scaling.type == "none":
        half = head_dim // 2
        freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    angle_BLE = positions_BL[..., None].astype(jnp.float32) * freq
    scale = magnitude(scaling)
    return apart(lambda a: _sin_cos(a, scale), angle_BLE) if cpu else _sin_cos(angle_BLE, scale)


def rotate(x_BLHE, tables):
    """Rotary position embedding (rotate-half form) applied in fp32, by `tables`."""
    sin, cos = tables
    x1, x2 = jnp.split(x_BLHE.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHE.dtype)
