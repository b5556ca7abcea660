"""Projections `x @ w` over x's last k axes and w's first k, and a backward pass XLA:CPU runs fast.

XLA:CPU computes a weight's gradient, x^T @ dy over every token, as a dot that contracts the
leading (token) axis of both operands. Its fast matmul path (XNNPACK/YNNPACK fusions) does not take
that form: the dot falls back to Eigen at about half the speed, and layout assignment first
transposes dy ([tokens, F] to [F, tokens], a strided copy). `project(..., cpu=True)` has its own
backward in which x^T is materialised behind an optimization barrier (so the simplifier cannot
fold the transpose back into the dot): x^T @ dy is then a plain [D, tokens] @ [tokens, F] matmul.
On configs/tiny.py's step on one CPU device that took the step from 87.8 to 75.4 ms (measured
with benchmarks/torch_reference.py). On accelerators, and on several devices, the plain einsum is used: the
partitioner places it, and the barrier would hide the transpose from it.

When x is an activation's output (GELU's: (u + b) * 0.5 * (1 + tanh(...))), XLA:CPU fuses the
activation's cheap tail into the transpose instead of reading the x the forward pass made: the
tail is computed again, element by element in transposed order, about 25 times slower than a
plain transpose of x ([768, 512]: 2.9 ms against 0.12 ms). The barrier is gone before fusion
runs, so `from_activation=True` puts the weight gradient inside a conditional (both branches
the same) that fusion cannot reach into: x is passed in whole. On the GPT-2 shape of
benchmarks/torch_reference.py that made the step 5-12% faster (three interleaved runs); on
SwiGLU's output it was no faster, so only the GELU MLP asks for it (layers.MLPS).
"""

from __future__ import annotations

import functools
import math
import string

import jax
import jax.numpy as jnp


def letters(x_ndim: int, w_ndim: int, k: int) -> tuple[str, str, str]:
    """(x's, w's and the output's einsum letters) of x [..., C1..Ck] @ w [C1..Ck, O...] -> [..., O...]."""
    names = iter(string.ascii_letters)
    batch = "".join(next(names) for _ in range(x_ndim - k))
    contract = "".join(next(names) for _ in range(k))
    out = "".join(next(names) for _ in range(w_ndim - k))
    return batch + contract, contract + out, batch + out


def _spec(x_ndim: int, w_ndim: int, k: int) -> str:
    """The einsum of x [..., C1..Ck] @ w [C1..Ck, O...] -> [..., O...]."""
    xs, ws, out = letters(x_ndim, w_ndim, k)
    return f"{xs},{ws}->{out}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cpu_project(x, w, k: int, from_activation: bool):
    return jnp.einsum(_spec(x.ndim, w.ndim, k), x, w)


def _cpu_fwd(x, w, k, from_activation):
    return _cpu_project(x, w, k, from_activation), (x, w)


def apart(fn, *args):
    """fn(*args) made whole, apart from its consumers, which XLA:CPU's fusion would otherwise
    recompute it into element by element: a conditional with fn on both branches, on a predicate
    XLA cannot fold (an element equal to itself: false only for a NaN, and the branches agree)."""
    first = jax.tree.leaves(args)[0].reshape(-1)[0]
    return jax.lax.cond(first == first, fn, fn, *args)


def _weight_grad(x2, dy2):
    """x^T @ dy as a plain matmul: x^T materialised, the barrier keeping it out of the dot."""
    return jax.lax.optimization_barrier(x2.T) @ dy2


def _cpu_bwd(k, from_activation, residuals, dy):
    x, w = residuals
    contract, out = math.prod(w.shape[:k]), math.prod(w.shape[k:])
    x2, w2 = x.reshape(-1, contract), w.reshape(contract, out)
    dy2 = dy.reshape(x2.shape[0], out)
    dx = (dy2 @ w2.T).reshape(x.shape)
    dw = apart(_weight_grad, x2, dy2) if from_activation else _weight_grad(x2, dy2)
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


_cpu_project.defvjp(_cpu_fwd, _cpu_bwd)


def project(x, w, k: int = 1, cpu: bool = False, from_activation: bool = False):
    """x's last k axes contracted with w's first k: [..., C...] @ [C..., O...] -> [..., O...];
    with `cpu`, the backward pass above (`from_activation`: x is an activation's output)."""
    return _cpu_project(x, w, k, from_activation) if cpu else jnp.einsum(_spec(x.ndim, w.ndim, k), x, w)
