"""Mistral 7B v0.3 (7.25B parameters: 32 layers, d_model 4096, GQA 32/8, SwiGLU 14336, vocab
32768, RoPE theta 1M, untied embeddings, no sliding window), seq 8192, for GPU/TPU pods.
Start from the checkpoint: python -m jaxscale.convert from-hf path/to/Mistral-7B-v0.3 converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/mistral_7b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="mistral", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                        d_ff=14336, vocab_size=32768, rope_theta=1000000.0, tie_embeddings=False,
                        max_seq_len=32768, norm_eps=1e-5, dtype="auto", remat="full")
    config.mesh.update(data=1, fsdp=-1)
    config.train.update(steps=10000, global_batch_size=256, seq_len=8192, log_every=10,
                        eval_every=1000, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
