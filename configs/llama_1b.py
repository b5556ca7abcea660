"""Llama-3.2-1B (1.2B parameters, GQA 32/8, RoPE theta 500k scaled by llama3 x32, tied embeddings)
for GPUs. Start from the checkpoint: python -m jaxscale.convert from-hf path/to/Llama-3.2-1B out/

Synthetic tokens by default; use --config.data.path=FILE.bin (uint32 for a 128k vocabulary:
--config.data.token_dtype=uint32) or a tokenizer.json with text files for real data. A data.path
(or data.mixture) given on the command line replaces the synthetic source.
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="llama", num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8,
                        d_ff=8192, vocab_size=128256, rope_theta=500000.0, tie_embeddings=True,
                        max_seq_len=131072, dtype="auto", remat="dots_saveable")
    config.model.rope_scaling.update(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_seq_len=8192)
    config.train.update(steps=5000, global_batch_size=16, seq_len=2048, log_every=20,
                        eval_every=500, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=200, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
