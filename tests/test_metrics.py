"""MFU arithmetic (PaLM convention), the peak table, and the writers."""

import json

import jax
import pytest

from jaxscale import metrics
from jaxscale.models import LanguageModel, ModelSpec


def test_peak_table():
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert metrics.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert metrics.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert metrics.peak_tflops("TPU v5 lite") == 197.0
    assert metrics.peak_tflops("cpu") is None


def test_flops_per_token_matches_hand_count():
    spec = ModelSpec(family="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                     vocab_size=256, tie_embeddings=False)
    params = jax.eval_shape(LanguageModel(spec).init, jax.random.PRNGKey(0))
    # per layer: q,o 64*64 each; k,v 64*32 each; mlp 3*64*128; two norms 64 each
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_layer + 64 + 64 * 256  # final norm + untied head; the embedding is excluded
    assert metrics.non_embedding_params(params) == n
    assert metrics.flops_per_token(spec, n, 128) == 6 * n + 12 * 2 * 4 * 16 * 128


def test_mfu():
    assert metrics.mfu(1000.0, 1e9, 2, None) is None
    assert metrics.mfu(1000.0, 1e9, 2, 100.0) == pytest.approx(1000 * 1e9 / (2 * 100e12))
