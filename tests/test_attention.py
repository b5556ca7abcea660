"""Attention kernel selection: cuDNN where it can run, xla elsewhere, one line saying which."""

import jax.numpy as jnp
import pytest

from jaxscale.build import build
from jaxscale.errors import ConfigError
from jaxscale.models.attention import resolve_impl


def test_auto_and_fallbacks():
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 64)[0] == "cudnn"
    assert resolve_impl("auto", "cpu", jnp.float32, 64) == (
        "xla", "attention: xla (cuDNN attention needs an NVIDIA GPU (platform is cpu))")
    assert resolve_impl("auto", "gpu", jnp.float32, 64)[0] == "xla"      # fp32 compute
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 12)[0] == "xla"     # head_dim not a multiple of 8
    assert resolve_impl("xla", "gpu", jnp.bfloat16, 64) == ("xla", None)
    impl, note = resolve_impl("cudnn", "tpu", jnp.bfloat16, 64)
    assert impl == "xla" and note.startswith("warning: model.attention.impl=cudnn falls back to xla")


def test_a_deterministic_run_takes_no_cudnn_attention():
    impl, note = resolve_impl("auto", "gpu", jnp.bfloat16, 64, deterministic=True)
    assert impl == "xla" and "not deterministic" in note
    with pytest.raises(ConfigError) as info:
        resolve_impl("cudnn", "gpu", jnp.bfloat16, 64, deterministic=True)
    assert info.value.field == "model.attention.impl" and "set model.attention.impl=xla" in str(info.value)


def test_run_reports_the_fallback(tiny_config):
    tiny_config.model.attention.impl = "cudnn"
    run = build(tiny_config)
    assert run.model.spec.attention_impl == "xla"
    assert [n for n in run.notes if n.startswith("warning:")] == [
        "warning: model.attention.impl=cudnn falls back to xla: cuDNN attention needs an NVIDIA GPU (platform is cpu)"]
