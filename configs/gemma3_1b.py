"""Gemma 3 1B (1.00B parameters: 26 layers, d_model 1152, GQA 4/1 of 256-wide heads with RMSNorm
on each query and key head, five sliding-window layers of 512 tokens to one global layer, local RoPE
theta 10k and global 1M, GeGLU 6912, vocab 262144, tied and sqrt(d_model)-scaled embeddings) for
one GPU. Start from the checkpoint: python -m jaxscale.convert from-hf path/to/gemma-3-1b-pt out/

Synthetic tokens by default; a data.path (or data.mixture) given on the command line replaces
them (uint32 tokens for a 262k vocabulary: --config.data.token_dtype=uint32).
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="gemma3", num_layers=26, d_model=1152, num_heads=4, num_kv_heads=1, head_dim=256,
                        d_ff=6912, vocab_size=262144, rope_theta=1000000.0, local_rope_theta=10000.0,
                        layer_pattern="LLLLLG", sliding_window=512, tie_embeddings=True, max_seq_len=32768,
                        norm_eps=1e-6, dtype="auto", remat="dots_saveable")
    config.train.update(steps=5000, global_batch_size=16, seq_len=2048, log_every=20,
                        eval_every=500, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=200, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
