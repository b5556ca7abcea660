"""Latent attention's kernels side by side on one device: cuDNN (values widened by zeros to the
keys' width, models.attention.widened), cuDNN's own form for narrower values where this JAX has
one (private API, measured only, not used), and the blockwise kernel (kernels.flash).

    python experiments/latent_attention.py [--batch=2] [--length=4096] [--heads=16] [--qk=192] [--v=128]
        [--repeats=20]

Causal attention of random bfloat16 queries, keys and values, DeepSeek-V3's head widths by
default (query and key 192 = 128 + 64 rotary, value 128). For each kernel: the largest
difference of its output and of its three input gradients (for one fixed random cotangent) from
the blockwise kernel run in float32, and the median time of a jit-compiled forward and backward
pass over --repeats runs. On a host without an NVIDIA GPU only the blockwise kernel runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxscale.models.attention import Placement, self_attention  # noqa: E402


def _native_cudnn():
    """cuDNN's attention with values narrower than the keys, through JAX's private cuDNN module,
    or None where this JAX has none."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        return None

    def run(q, k, v):
        return fused.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask_type=fused.MaskType.CAUSAL)
    return run


def _kernels(positions) -> dict:
    places = Placement(positions)
    kernels = {"blockwise": functools.partial(_ours, places=places, impl="xla")}
    if jax.default_backend() == "gpu":
        kernels["cudnn, values widened"] = functools.partial(_ours, places=places, impl="cudnn")
        native = _native_cudnn()
        if native is not None:
            kernels["cudnn, own narrower values"] = native
    return kernels


def _ours(q, k, v, places, impl):
    return self_attention(q, k, v, places, impl)


def _forward_backward(kernel, q, k, v, cotangent):
    out, pullback = jax.vjp(kernel, q, k, v)
    return (out, *pullback(cotangent))


def _time(step, args, repeats: int) -> float:
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 2), ("length", 4096), ("heads", 16), ("qk", 192), ("v", 128), ("repeats", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (args.batch, args.length, args.heads)
    q, k = (jax.random.normal(key, (*shape, args.qk), jnp.bfloat16) for key in keys[:2])
    v = jax.random.normal(keys[2], (*shape, args.v), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], (*shape, args.v), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(args.length), shape[:2])
    kernels = _kernels(positions)
    wide = [x.astype(jnp.float32) for x in (q, k, v, cotangent)]
    reference = jax.jit(functools.partial(_forward_backward, kernels["blockwise"]))(*wide)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; batch {args.batch}, length {args.length}, "
          f"{args.heads} heads, query/key {args.qk}, value {args.v}, bfloat16, causal")
    print("| kernel | forward + backward | largest difference from float32 blockwise: out, dq, dk, dv |")
    print("|---|---|---|")
    for name, kernel in kernels.items():
        step = jax.jit(functools.partial(_forward_backward, kernel))
        try:
            got = step(q, k, v, cotangent)
        except Exception as error:  # noqa: BLE001  (a kernel this JAX or GPU cannot run is reported, not fatal)
            print(f"| {name} | fails: {str(error).splitlines()[0][:120]} | |")
            continue
        errors = ", ".join(f"{float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))):.3g}" for a, b in zip(got, reference))
        print(f"| {name} | {_time(step, (q, k, v, cotangent), args.repeats) * 1e3:.2f} ms | {errors} |")


if __name__ == "__main__":
    main()
