"""Qwen3 8B (8.19B parameters: 36 layers, d_model 4096, GQA 32/8 of 128-wide heads with RMSNorm
on each query and key head, SwiGLU 12288, vocab 151936, RoPE theta 1M, untied embeddings), seq
8192, for GPU/TPU pods (configs/llama3_8b.py's mesh, batch and optimizer). Start from the checkpoint:
python -m jaxscale.convert from-hf path/to/Qwen3-8B converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/qwen3_8b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama3_8b.py")))  # its mesh, batch, optimizer and data
    config.model.update(family="qwen3", num_layers=36, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        d_ff=12288, vocab_size=151936, rope_theta=1000000.0, tie_embeddings=False,
                        max_seq_len=40960, norm_eps=1e-6)
    return config
