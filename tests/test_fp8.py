"""fp8 projections (models/fp8.py): the matmul within fp8's precision with its gradients, a tiny
model trained with them beside bfloat16, and the platforms that refuse them."""

import statistics

import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT, fast_run_steps
from jaxscale import cli
from jaxscale.build import build
from jaxscale.errors import ConfigError
from jaxscale.models import fp8
from jaxscale.trainer import Trainer


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


SEEDS = (0, 1, 2)


def _trained(fp8_on: bool, seed: int, workdir, steps: int = 50) -> tuple[float, float]:
    """(the first loss, the mean of the last 10) of configs/tiny.py in bfloat16 on one CPU device,
    at global batch 4 and length 64 (a quarter and a half of the config's), from seed `seed`,
    every step logged: a Trainer in this process. The step is the same program for every seed,
    compiled once."""
    config = cli.load_config(str(ROOT / "configs" / "tiny.py"), [
        "mesh.data=1", "model.dtype=bfloat16", f"model.fp8={fp8_on}", f"train.steps={steps}",
        "train.global_batch_size=4", "train.seq_len=64", f"train.seed={seed}", "train.log_every=1",
        "train.eval_every=0", "checkpoint.every_steps=0", "tracking.writers=jsonl", "tracking.report=False",
        "metrics.progress=False"])
    with Trainer(config, workdir, devices=jax.devices()[:1]) as trainer:
        losses = [record["loss"] for record in trainer.run()]
    assert len(losses) == steps
    return losses[0], statistics.mean(losses[-10:])


def test_tiny_trains_in_fp8_beside_bfloat16(tmp_path):
    """50 steps from each of 3 seeds: from each seed fp8 starts where bfloat16 does and its loss
    falls by at least half as much, and its mean final loss over the seeds is within twice
    bfloat16's own spread over them. A short CPU run's loss depends on the machine's code
    generation (200 steps read fp8 2.597 against bfloat16 2.861 on one x86 VM, 2.682 against 2.722
    on another), so the bound is the runs' own noise, not a fixed share. Measured on a 2-core Intel
    Xeon VM, steps compiled at -O1 (fast_run_steps): bfloat16 ends 3.171, 3.118, 2.995 (spread 0.176, so
    the bound is 0.35), fp8 3.112, 3.198, 2.979 (means 0.001 apart); from starts of 5.04-5.50 each
    seed's fp8 fell 0.97-1.03 as far as its bfloat16. (At -O0 on a 2-core AMD EPYC VM: bfloat16
    spread 0.095, means 0.012 apart, falls 0.95-1.02.)"""
    with fast_run_steps():
        bf16 = [_trained(False, seed, tmp_path / f"bf16_{seed}") for seed in SEEDS]
        fp8_runs = [_trained(True, seed, tmp_path / f"fp8_{seed}") for seed in SEEDS]
    for (start16, end16), (start8, end8) in zip(bf16, fp8_runs):
        assert start8 == pytest.approx(start16, rel=0.02)
        assert start8 - end8 > 0.5 * (start16 - end16), (start16, end16, start8, end8)
    ends16, ends8 = [end for _, end in bf16], [end for _, end in fp8_runs]
    spread = max(ends16) - min(ends16)
    assert abs(statistics.mean(ends8) - statistics.mean(ends16)) <= 2 * spread, (ends16, ends8)


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
