"""Gemma 2 2B (2.61B parameters: 26 layers, d_model 2304, GQA 8/4 of 256-wide heads, sliding-window
(4096) and global layers in turn, attention scores soft-capped at 50 and logits at 30, GeGLU 9216,
vocab 256000, tied and sqrt(d_model)-scaled embeddings) for one GPU, trained as configs/gemma3_1b.py.
Start from the checkpoint: python -m jaxscale.convert from-hf path/to/gemma-2-2b out/
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("gemma3_1b.py")))  # its batch, optimizer and data
    config.model.update(family="gemma2", num_layers=26, d_model=2304, num_heads=8, num_kv_heads=4, head_dim=256,
                        d_ff=9216, vocab_size=256000, rope_theta=10000.0, local_rope_theta=0.0, layer_pattern="LG",
                        sliding_window=4096, attn_logit_softcap=50.0, final_logit_softcap=30.0, max_seq_len=8192)
    return config
