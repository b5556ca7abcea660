"""Llama 2 70B (69.0B parameters: 80 layers, d_model 8192, GQA 64/8, SwiGLU 28672, vocab 32000,
RoPE theta 10k, untied embeddings), seq 4096, for GPU/TPU pods. Start from the checkpoint:
python -m jaxscale.convert from-hf path/to/Llama-2-70b-hf converted/

Global batch 1024 x 4096 tokens (4M tokens a step: four sequences per chip of a v5p-512, as
MaxText's v5p recipe runs it). Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/llama2_70b.py --topology=v5p-512      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama3_8b.py")))  # its mesh, optimizer and data
    config.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672, vocab_size=32000,
                        rope_theta=10000.0, max_seq_len=4096)
    config.train.update(global_batch_size=1024, seq_len=4096)
    return config
