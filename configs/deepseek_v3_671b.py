"""DeepSeek-V3 (671B parameters, 37B active a token: 61 layers, d_model 7168, 128 heads of
multi-head latent attention: a query latent of 1536, a key/value latent of 512, each head's query
and key 128 non-rotary + 64 rotary dimensions, its value 128; the first 3 layers dense (SwiGLU
18432), then 256 SwiGLU experts of 2048 a layer, top-8 from the 4 best of 8 groups by sigmoid
scores, weights renormalised x 2.5, one shared expert; vocab 129280, YaRN RoPE x40 over 4096
positions, untied embeddings), seq 4096, dropless, for TPU/GPU pods. Balanced without an
auxiliary loss (bias_rate 0.001) beside DeepSeek's small sequence-wise loss (0.0001); one
multi-token prediction module (an MoE layer: 11.6B parameters more), its loss weighted 0.3 as in
DeepSeek's first 10T tokens. Start from the checkpoint (DeepSeek-V3, R1 and V3.1 share it):
  python -m jaxscale.convert from-hf path/to/DeepSeek-V3 converted/
its MTP module is not imported: train the converted model with --config.model.mtp_depth=0.

Experts split 8 ways (mesh.expert=8) and FSDP over the other devices; every other weight split
over fsdp x expert. configs/mixtral_8x7b.py's batch and optimizer. Plan it before launch:
  python -m jaxscale.plan --config=configs/deepseek_v3_671b.py --topology=v5p-512      # needs jaxscale[tpu]
"""

import math
from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("mixtral_8x7b.py")))  # its mesh, batch, optimizer and data
    config.model.update(family="deepseek_v3", num_layers=61, d_model=7168, num_heads=128, num_kv_heads=128,
                        d_ff=18432, vocab_size=129280, rope_theta=10000.0, tie_embeddings=False,
                        max_seq_len=163840, norm_eps=1e-6, mtp_depth=1, mtp_loss_weight=0.3,
                        query_scale=192 / (0.1 * math.log(40) + 1) ** 4)  # scores x YaRN's mscale(40)^2
    config.model.rope_scaling.update(type="yarn", factor=40.0, original_max_seq_len=4096, beta_fast=32.0,
                                     beta_slow=1.0, attention_factor=1.0, truncate=True)
    config.model.mla.update(kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, nope_head_dim=128, v_head_dim=128)
    config.model.moe.update(num_experts=256, top_k=8, d_ff=2048, capacity_factor=0.0, every_n_layers=1,
                            first_dense=3, num_shared=1, score="sigmoid", expert_groups=8, top_groups=4,
                            routed_scale=2.5, renormalize=True, bias_rate=0.001, aux_loss_weight=0.0001,
                            z_loss_weight=0.0)
    config.mesh.update(expert=8)
    return config
