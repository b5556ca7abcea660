"""The optimizer: schedule shape and which parameters decay."""

import jax
import pytest

from jaxscale.config import defaults
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.optim import decay_mask, make_schedule


def test_schedule_warms_up_then_decays_to_floor():
    cfg = defaults().optim
    cfg.update(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    schedule = make_schedule(cfg, total_steps=100)
    assert schedule(0) == pytest.approx(1e-4)            # the first update already learns
    assert schedule(9) == pytest.approx(1e-3)            # peak at the end of warmup
    assert schedule(54) < schedule(20) < schedule(9)
    assert schedule(99) == pytest.approx(1e-4, rel=1e-3)  # lr * min_lr_ratio at the last step


def test_weight_decay_skips_norms_and_biases():
    spec = ModelSpec(family="gpt2", num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, vocab_size=32)
    mask = decay_mask(jax.eval_shape(LanguageModel(spec).init, jax.random.PRNGKey(0)))
    assert mask["embed"] and mask["pos_embed"] and mask["layers"]["attn"]["wq"] and mask["layers"]["mlp"]["w_in"]
    assert not mask["final_norm"]["scale"] and not mask["final_norm"]["bias"]
    assert not mask["layers"]["attn"]["bias_q"] and not mask["layers"]["mlp"]["bias_out"]
