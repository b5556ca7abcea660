"""fp8 projections (models/fp8.py): the matmul within fp8's precision with its gradients, a tiny
model trained with them beside bfloat16, and the platforms that refuse them."""

import statistics

import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT
from jaxscale import cli
from jaxscale.build import build
from jaxscale.data import make_data
from jaxscale.errors import ConfigError
from jaxscale.models import fp8


def _relative(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("shapes", [((4, 64, 128), (128, 384), 1), ((4, 64, 4, 32), (4, 32, 128), 2)])
def test_the_fp8_matmul_and_its_gradients_are_within_fp8_s_precision(shapes):
    """e4m3 operands (3 mantissa bits: 3.6% rms rounding) for the product, e5m2 gradients (2
    bits) for dx and dw: measured 3.7% and 5.9% from the exact product and gradients."""
    x_shape, w_shape, k = shapes
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(keys[0], x_shape), 0.05 * jax.random.normal(keys[1], w_shape)
    exact = jnp.tensordot(x, w, k)
    y, pullback = jax.vjp(lambda x, w: fp8.project(x, w, k), x, w)
    g = jax.random.normal(keys[2], y.shape)
    dx, dw = pullback(g)
    want_dx, want_dw = jax.vjp(lambda x, w: jnp.tensordot(x, w, k), x, w)[1](g)
    assert _relative(y, exact) < 0.05 and _relative(dx, want_dx) < 0.08 and _relative(dw, want_dw) < 0.08
    assert _relative(y, exact) > 0.01  # it did round to 8 bits


def _trained(fp8_on: bool, steps: int = 200) -> tuple[float, float]:
    """(the first loss, the mean of the last 10) of configs/tiny.py in bfloat16 on one CPU device,
    at global batch 4 (a quarter of the config's, for the suite's time)."""
    config = cli.load_config(str(ROOT / "configs" / "tiny.py"), ["mesh.data=1", "model.dtype='bfloat16'",
                                                                 f"model.fp8={fp8_on}", f"train.steps={steps}",
                                                                 "train.global_batch_size=4"])
    run = build(config, jax.devices()[:1])
    compiled, _ = run.compile()
    state, batches = run.init_state(), make_data(config, run.batch_sharding).train_batches(0)
    losses = []
    for _ in range(steps):
        state, metrics = compiled(state, next(batches))
        losses.append(metrics["loss"])
    losses = [float(loss) for loss in jax.device_get(losses)]
    return losses[0], statistics.mean(losses[-10:])


def test_tiny_trains_in_fp8_beside_bfloat16():
    """200 steps from the same start: fp8 ends within 2% of bfloat16's loss (measured: 2.682
    against 2.722 over the last 10 steps). At 200 steps the gap moves with the shape more than
    with fp8: -0.3% at batch 8, +4.9% at the config's batch of 16 (+2.3% by step 500), +12.7%
    at batch 8 x 64 tokens."""
    (start16, end16), (start8, end8) = _trained(False), _trained(True)
    assert start8 == pytest.approx(start16, rel=0.02) and end8 < 0.5 * start8
    assert end8 == pytest.approx(end16, rel=0.02)


def test_fp8_is_refused_where_there_are_no_fp8_matmuls():
    assert fp8.unsupported("cpu", None) is None  # emulated, for development and tests
    assert "the platform is tpu" in fp8.unsupported("tpu", None)

    class Ampere:
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    assert "no fp8 tensor cores" in fp8.unsupported("gpu", [Ampere()])
    config = cli.load_config(str(ROOT / "configs" / "tiny.py"), ["mesh.data=1", "model.fp8=True"])
    with pytest.raises(ConfigError) as info:
        build(config, jax.devices()[:1], platform="tpu")
    assert info.value.field == "model.fp8"
