"""Tiny Llama-style mixture-of-experts model on the embedded corpus: configs/tiny.py with 8 SwiGLU
experts (top-2) in every second layer; trains on a 2-core laptop CPU in about a minute.

Expert parallelism: --config.mesh.expert=E (E divides 8) splits the experts, and the batch, over E devices.
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="llama", num_layers=4, d_model=128, num_heads=4, num_kv_heads=2,
                        d_ff=384, vocab_size=256, tie_embeddings=True)
    config.model.moe.update(num_experts=8, top_k=2, capacity_factor=1.25, every_n_layers=2, d_ff=192)
    config.train.update(steps=200, global_batch_size=16, seq_len=128, log_every=25,
                        eval_every=100, eval_batches=4)
    config.optim.update(lr=3e-3, warmup_steps=30, weight_decay=0.1, clip_norm=1.0)
    return config
