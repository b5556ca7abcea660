"""Qwen3 1.7B (1.72B parameters: 28 layers, d_model 2048, GQA 16/8 of 128-wide heads with
RMSNorm on each query and key head, SwiGLU 6144, vocab 151936, RoPE theta 1M, tied embeddings)
for one GPU. Start from the checkpoint: python -m jaxscale.convert from-hf path/to/Qwen3-1.7B out/

Synthetic tokens by default; a data.path (or data.mixture) given on the command line replaces
them (uint32 tokens for a 152k vocabulary: --config.data.token_dtype=uint32).
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="qwen3", num_layers=28, d_model=2048, num_heads=16, num_kv_heads=8, head_dim=128,
                        d_ff=6144, vocab_size=151936, rope_theta=1000000.0, tie_embeddings=True,
                        max_seq_len=40960, norm_eps=1e-6, dtype="auto", remat="dots_saveable")
    config.train.update(steps=5000, global_batch_size=16, seq_len=2048, log_every=20,
                        eval_every=500, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=200, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
