"""The jitted train step: device-count independence, accumulation, one reduction per step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import state as state_lib
from jaxscale.mesh import make_mesh
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.optim import make_optimizer
from jaxscale.sharding import batch_sharding
from jaxscale.step import compute_dtype, jit_train_step

SPEC = ModelSpec(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128)


def _batch(rows=32, length=32, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _run(devices, accum, optim_cfg, steps=2, rows=32, vary=True, dtype=jnp.float32):
    """(metrics per step, final params) of `steps` updates on a data mesh of `devices`."""
    mesh = make_mesh({"data": devices, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
                     jax.devices()[:devices])
    model = LanguageModel(SPEC)
    tx, schedule = make_optimizer(optim_cfg, 10)
    state, shardings = state_lib.init(model, tx, 0, mesh)
    shd = batch_sharding(mesh)
    step = jit_train_step(model, tx, schedule, dtype, accum, shardings, shd)
    history = []
    for i in range(steps):
        batch = jax.device_put(_batch(rows, seed=i if vary else 0), shd)
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params), step, state, batch


@pytest.fixture(scope="module")
def optim_cfg():
    from jaxscale.config import defaults
    return defaults().optim


@pytest.fixture(scope="module")
def reference(optim_cfg):
    return _run(1, 1, optim_cfg)


def _assert_same(a, b, rtol):
    for ma, mb in zip(a[0], b[0]):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(ma[key], mb[key], rtol=rtol)
    # Adam divides by sqrt(v): parameters agree to a fraction of one update (lr = 3e-4).
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-5), a[1], b[1])


def test_eight_devices_equal_one(reference, optim_cfg):
    _assert_same(_run(8, 1, optim_cfg), reference, rtol=1e-5)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_accumulation_equals_one_big_batch(reference, optim_cfg, devices):
    _assert_same(_run(devices, 4, optim_cfg), reference, rtol=1e-5)


def test_accumulation_reduces_gradients_once_per_step(optim_cfg):
    *_, step, state, batch = _run(8, 4, optim_cfg, steps=1)
    hlo = step.lower(state, batch).compile().as_text()
    reductions = re.findall(r"all-reduce\(.*", hlo)
    assert reductions, "expected a gradient all-reduce"
    for line in reductions:
        # no reduction inside the microbatch loop: every one comes from the final pmean
        assert "shard_map" in line and "while/body" not in line, line


def test_loss_falls_and_lr_warms_up(optim_cfg):
    fast = optim_cfg.copy_and_resolve_references()
    fast.update(lr=1e-2, warmup_steps=5)
    history, *_ = _run(2, 1, fast, steps=12, rows=8, vary=False)  # memorise one batch
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert 0 < history[0]["lr"] < history[5]["lr"]
    assert int(history[0]["tokens"]) == 8 * 32


def test_bfloat16_compute_keeps_float32_master_weights(reference, optim_cfg):
    history, params, *_ = _run(8, 1, optim_cfg, dtype=jnp.bfloat16)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))
    np.testing.assert_allclose(history[0]["loss"], reference[0][0]["loss"], rtol=1e-2)
    assert history[0]["loss"].dtype == np.float32


def test_compute_dtype():
    assert compute_dtype("auto", "cpu") == jnp.float32
    assert compute_dtype("auto", "gpu") == jnp.bfloat16
    assert compute_dtype("bfloat16") == jnp.bfloat16


def test_remat_policies_trade_compiled_memory(optim_cfg):
    """Temp bytes from compiled.memory_analysis(): none > dots_saveable > full."""
    mesh = make_mesh({"data": 1, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
                     jax.devices()[:1])
    shd = batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=shd)
    temp = {}
    for remat in ("none", "dots_saveable", "full"):
        model = LanguageModel(ModelSpec(num_layers=4, d_model=64, num_heads=4, num_kv_heads=4, d_ff=256, remat=remat))
        tx, schedule = make_optimizer(optim_cfg, 10)
        state = state_lib.abstract(model, tx, mesh)
        step = jit_train_step(model, tx, schedule, jnp.float32, 1, state_lib.shardings(model, tx, mesh), shd)
        compiled = step.lower(state, {"inputs": tokens, "targets": tokens}).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["none"] > 1.5 * temp["dots_saveable"] and temp["dots_saveable"] > 1.5 * temp["full"], temp
