"""Loss masks (batch['mask']: 1 where a target is trained): a masked target gets no gradient, and
the loss is the mean over the trained targets of the whole global batch, the same on every layout
and under gradient accumulation however unevenly the trained tokens fall."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build_for, initial_state
from jaxscale import step as step_lib
from jaxscale.config import defaults
from jaxscale.models import ModelSpec

SPEC = ModelSpec(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, d_ff=128)
ROWS, LENGTH = 16, 32


def _batch(seed: int) -> dict:
    """Random tokens; each row trains on its targets from a random prompt length on, a second
    untrained span in every third row (a user turn between answers), and row 0 trains on none."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (ROWS, LENGTH + 1)).astype(np.int32)
    mask = (np.arange(LENGTH)[None] >= rng.integers(1, LENGTH - 1, (ROWS, 1))).astype(np.int32)
    mask[::3, LENGTH - 6:LENGTH - 3] = 0
    mask[0] = 0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _run(steps: int = 2, accum: int = 1, **layout):
    """(metrics per step, final params) of `steps` updates on masked batches."""
    optim = defaults().optim
    run = build_for(SPEC, optim=optim, accum=accum, rows=ROWS, seq_len=LENGTH, **layout)
    state = initial_state(run, (SPEC, optim.to_json()))
    history = []
    for i in range(steps):
        state, metrics = run.train_step(state, jax.device_put(_batch(i), run.batch_sharding))
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    return _run(devices=1)


@pytest.fixture(scope="module")
def single():
    optim = defaults().optim
    run = build_for(SPEC, optim=optim, rows=ROWS, seq_len=LENGTH, devices=1)
    return run, initial_state(run, (SPEC, optim.to_json())).params


def test_the_loss_is_the_mean_over_trained_targets_and_masked_ones_get_no_gradient(single):
    run, params = single
    grads_of = jax.jit(lambda p, b: step_lib.loss_and_grads(p, b, run.step_spec))
    batch = _batch(0)
    stats, grads = grads_of(params, batch)
    # The definition, from whole float32 logits: the mean over the targets the mask keeps.
    logits = run.model.apply(params, batch["inputs"])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    want = -jnp.sum(picked * batch["mask"]) / batch["mask"].sum()
    np.testing.assert_allclose(stats["loss"], want, rtol=1e-6)
    row, column = 4, int(np.argmin(batch["mask"][4]))  # an untrained target (row 4 has its prompt)
    assert batch["mask"][row, column] == 0
    for changed, same in ((column, True), (LENGTH - 1, False)):  # last: trained in every row but 0
        other = {**batch, "targets": batch["targets"].copy()}
        other["targets"][row, changed] = (other["targets"][row, changed] + 1) % 256
        _, moved = grads_of(params, other)
        equal = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), grads, moved))
        assert all(equal) if same else not all(equal)


# Every way the batch is cut into pieces whose losses are averaged: microbatches per data replica
# (ZeRO 0), microbatches with gradients split over data (ZeRO-2), a pipeline's microbatches on
# each batch shard, and the tokens reordered for context parallelism.
LAYOUTS = {
    "data2_fsdp2_tensor2_accum2": (2, dict(data=2, fsdp=2, tensor=2)),
    "data4_zero2_accum2": (2, dict(data=4, zero_stage=2)),
    "data2_pipeline2_gpipe_accum2": (2, dict(data=2, pipeline=2, microbatches=2)),
    "data2_sequence2_ring": (1, dict(data=2, sequence=2)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_masked_loss_on_every_layout_equals_one_device(one_device, name):
    accum, layout = LAYOUTS[name]
    got, want = _run(accum=accum, **layout), one_device
    for a, b in zip(got[0], want[0]):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5)
        assert a["trained_tokens"] == b["trained_tokens"] < a["tokens"] == ROWS * LENGTH  # counted once
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), got[1], want[1])


def test_the_trained_tokens_metric_counts_the_targets_the_mask_keeps(one_device):
    assert [int(m["trained_tokens"]) for m in one_device[0]] == [int(_batch(i)["mask"].sum()) for i in range(2)]
