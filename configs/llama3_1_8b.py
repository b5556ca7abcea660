"""Llama 3.1 8B (8.0B parameters: Llama 3 8B's shape, its RoPE scaled by llama3 x8 from an 8192
pretrained context to 131072), seq 8192, for GPU/TPU pods. Llama 3.2 and 3.3 scale RoPE the same
way. Start from the checkpoint: python -m jaxscale.convert from-hf path/to/Llama-3.1-8B converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/llama3_1_8b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="llama", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                        d_ff=14336, vocab_size=128256, rope_theta=500000.0, tie_embeddings=False,
                        max_seq_len=131072, norm_eps=1e-5, dtype="auto", remat="full")
    config.model.rope_scaling.update(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_seq_len=8192)
    config.mesh.update(data=1, fsdp=-1)  # FSDP over every device: 8B does not fit unsharded
    config.train.update(steps=10000, global_batch_size=256, seq_len=8192, log_every=10,
                        eval_every=1000, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
