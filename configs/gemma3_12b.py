"""Gemma 3 12B, its text model (11.77B parameters: 48 layers, d_model 3840, GQA 16/8 of 256-wide
heads with RMSNorm on each query and key head, five sliding-window layers of 1024 tokens to one
global layer, local RoPE theta 10k and global 1M scaled linearly x8, GeGLU 15360, vocab 262208,
tied and sqrt(d_model)-scaled embeddings), seq 8192, for GPU/TPU pods (configs/llama3_8b.py's
mesh, batch and optimizer). Start from the checkpoint (its text model; the vision encoder is left out):
python -m jaxscale.convert from-hf path/to/gemma-3-12b-pt converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/gemma3_12b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama3_8b.py")))  # its mesh, batch, optimizer and data
    config.model.update(family="gemma3", num_layers=48, d_model=3840, num_heads=16, num_kv_heads=8, head_dim=256,
                        d_ff=15360, vocab_size=262208, rope_theta=1000000.0, local_rope_theta=10000.0,
                        layer_pattern="LLLLLG", sliding_window=1024, tie_embeddings=True, max_seq_len=131072,
                        norm_eps=1e-6)
    config.model.rope_scaling.update(type="linear", factor=8.0)
    return config
