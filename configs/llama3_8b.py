"""Llama 3 8B (8.0B parameters: 32 layers, d_model 4096, GQA 32/8, SwiGLU 14336, vocab 128256,
RoPE theta 500k, untied embeddings), seq 8192, for GPU/TPU pods.

Global batch 256 x 8192 tokens (2M tokens a step: two sequences per chip of a v5p-256).
Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/llama3_8b.py --topology=v5p-256      # needs jaxscale[tpu]
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxscale.plan \
      --config=configs/llama3_8b.py --config.mesh.fsdp=8 --config.train.global_batch_size=8 --platform=gpu
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="llama", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                        d_ff=14336, vocab_size=128256, rope_theta=500000.0, tie_embeddings=False,
                        dtype="auto", remat="full")
    config.mesh.update(data=1, fsdp=-1)  # FSDP over every device: 8B does not fit unsharded
    config.train.update(steps=10000, global_batch_size=256, seq_len=8192, log_every=10,
                        eval_every=1000, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
