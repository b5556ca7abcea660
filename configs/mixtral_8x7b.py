"""Mixtral 8x7B (46.7B parameters, 12.9B active a token: 32 layers, d_model 4096, GQA 32/8,
8 SwiGLU experts of 14336 in every layer, top-2, vocab 32000, RoPE theta 1M, untied
embeddings), seq 4096, for TPU/GPU pods. Start from the checkpoint (imported dropless, as
transformers computes it): python -m jaxscale.convert from-hf path/to/Mixtral-8x7B-v0.1 converted/

Experts split 8 ways (mesh.expert=8), the rest FSDP over every other device; global batch 256 x
4096 tokens (1M a step: two sequences per chip of a v5p-256). Plan it before launch:
  python -m jaxscale.plan --config=configs/mixtral_8x7b.py --topology=v5p-256      # needs jaxscale[tpu]
"""

from jaxscale.config import defaults


def get_config():
    config = defaults()
    config.model.update(family="mixtral", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                        d_ff=14336, vocab_size=32000, rope_theta=1000000.0, tie_embeddings=False,
                        dtype="auto", remat="full")
    config.model.moe.update(num_experts=8, top_k=2, capacity_factor=1.25, every_n_layers=1)
    config.mesh.update(data=1, expert=8, fsdp=-1)
    config.train.update(steps=10000, global_batch_size=256, seq_len=4096, log_every=10,
                        eval_every=1000, eval_batches=4)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0, b2=0.95)
    config.data.update(source="synthetic")
    return config
