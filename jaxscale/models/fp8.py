"""fp8 projections (`model.fp8=true`): a layer's matmuls with 8-bit float operands, float32
accumulation, and float32 master weights, with per-tensor scaling computed on the step
(current scaling, as Transformer Engine's Float8CurrentScaling: no amax history to keep).

Forward: x and w are each scaled so their largest magnitude lands on e4m3's largest (448),
cast to float8_e4m3fn, multiplied with float32 accumulation and the product unscaled. Backward:
the output's gradient is scaled into e5m2 (largest 57344: gradients want range more than
precision), and dx = g @ w^T, dw = x^T @ g run on the saved e4m3 operands and the e5m2
gradient, each unscaled. The saved residuals are the 8-bit operands and two scalars. On an
NVIDIA GPU of compute capability 8.9 or more (Ada, Hopper) XLA runs these as cuBLASLt fp8
GEMMs; on a CPU XLA computes the same numbers in wider types (for tests and development).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxscale.models.matmul import letters

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MIN_CAPABILITY = (8, 9)  # NVIDIA: the first with fp8 tensor cores (Ada); Hopper is 9.0


def quantize(x, dtype):
    """(x scaled into dtype's range and cast to it, the scale to multiply back by): one scale for
    the tensor, its largest magnitude landing on dtype's largest."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x, w, k: int = 1):
    """x's last k axes contracted with w's first k, in fp8 (see the module docstring); the
    result in x's dtype."""
    return _forward(x, w, k)[0]


def _forward(x, w, k):
    xq, x_scale = quantize(x, E4M3)
    wq, w_scale = quantize(w, E4M3)
    xs, ws, out = letters(x.ndim, w.ndim, k)
    y = jnp.einsum(f"{xs},{ws}->{out}", xq, wq, preferred_element_type=jnp.float32) * (x_scale * w_scale)
    return y.astype(x.dtype), (xq, x_scale, wq, w_scale, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _fwd(x, w, k):
    return _forward(x, w, k)


def _bwd(k, residuals, g):
    """dx = g @ w^T and dw = x^T @ g on the saved e4m3 operands and the e5m2 gradient."""
    xq, x_scale, wq, w_scale, x_like, w_like = residuals
    gq, g_scale = quantize(g, E5M2)
    xs, ws, out = letters(xq.ndim, wq.ndim, k)
    dx = jnp.einsum(f"{out},{ws}->{xs}", gq, wq, preferred_element_type=jnp.float32) * (g_scale * w_scale)
    dw = jnp.einsum(f"{xs},{out}->{ws}", xq, gq, preferred_element_type=jnp.float32) * (x_scale * g_scale)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


project.defvjp(_fwd, _bwd)


def unsupported(platform: str, devices) -> str | None:
    """None if fp8 matmuls run (or are emulated, on CPU) for these devices, else why not."""
    if platform == "cpu":
        return None
    if platform != "gpu":
        return f"fp8 matmuls here are NVIDIA's (compute capability {'.'.join(map(str, MIN_CAPABILITY))}+); " \
               f"the platform is {platform}"
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    if capability and tuple(int(p) for p in str(capability).split(".")[:2]) < MIN_CAPABILITY:
        return f"this GPU ({devices[0].device_kind}, compute capability {capability}) has no fp8 tensor cores"
    return None

