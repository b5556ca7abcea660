"""GPT-2 small (124M) for one or more GPUs, nanoGPT-style: seq 1024, bf16 compute, fp32 master weights.

Synthetic tokens by default; point it at real data with a nanoGPT token file, e.g.
  --config.data.path=train.bin   (uint16 GPT-2 BPE tokens)
A data.path (or data.mixture) given on the command line replaces the synthetic source.
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="gpt2", num_layers=12, d_model=768, num_heads=12, num_kv_heads=12,
                        d_ff=3072, vocab_size=50304, max_seq_len=1024, tie_embeddings=True,
                        dtype="auto", remat="none")
    config.train.update(steps=5000, global_batch_size=32, seq_len=1024, log_every=50,
                        eval_every=500, eval_batches=8)
    config.optim.update(lr=6e-4, warmup_steps=500, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
