"""Qwen3-30B-A3B (30.5B parameters, 3.3B active a token: 48 layers, d_model 2048, GQA 32/4 of
128-wide heads with RMSNorm on each query and key head, 128 SwiGLU experts of 768 in every layer,
top-8 with the chosen probabilities renormalised, vocab 151936, RoPE theta 1M, untied embeddings),
seq 4096, dropless, for TPU/GPU pods. Start from the checkpoint:
python -m jaxscale.convert from-hf path/to/Qwen3-30B-A3B converted/

Experts split 8 ways (mesh.expert=8), the rest FSDP over every other device (a v5p-128 is
expert=8 x fsdp=8); configs/mixtral_8x7b.py's batch and optimizer. Plan it before launch:
  python -m jaxscale.plan --config=configs/qwen3_30b_a3b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("mixtral_8x7b.py")))  # its mesh, batch, optimizer and data
    config.model.update(family="qwen3_moe", num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                        d_ff=6144, vocab_size=151936, rope_theta=1000000.0, tie_embeddings=False,
                        max_seq_len=40960, norm_eps=1e-6)
    config.model.moe.update(num_experts=128, top_k=8, d_ff=768, capacity_factor=0.0, every_n_layers=1,
                            renormalize=True, aux_loss_weight=0.001, z_loss_weight=0.0)
    return config
