"""Tiny Llama-style model on the embedded corpus: trains on a 2-core laptop CPU in about a minute."""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="llama", num_layers=2, d_model=128, num_heads=4, num_kv_heads=2,
                        d_ff=384, vocab_size=256, tie_embeddings=True)
    config.train.update(steps=300, global_batch_size=16, seq_len=128, log_every=25,
                        eval_every=100, eval_batches=4)
    config.optim.update(lr=3e-3, warmup_steps=30, weight_decay=0.1, clip_norm=1.0)
    return config
