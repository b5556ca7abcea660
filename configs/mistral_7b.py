"""Mistral 7B v0.3 (7.25B parameters: 32 layers, d_model 4096, GQA 32/8, SwiGLU 14336, vocab 32768,
RoPE theta 1M, untied embeddings, no sliding window), seq 8192, for GPU/TPU pods (configs/llama3_8b.py's
mesh, batch and optimizer). Start from the checkpoint:
python -m jaxscale.convert from-hf path/to/Mistral-7B-v0.3 converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/mistral_7b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama3_8b.py")))  # its mesh, batch, optimizer and data
    config.model.update(family="mistral", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                        d_ff=14336, vocab_size=32768, rope_theta=1000000.0, tie_embeddings=False,
                        max_seq_len=32768, norm_eps=1e-5)
    return config
