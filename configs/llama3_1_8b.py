"""Llama 3.1 8B (8.0B parameters: configs/llama3_8b.py, its RoPE scaled by llama3 x8 from an 8192
pretrained context to 131072), seq 8192, for GPU/TPU pods. Llama 3.2 and 3.3 scale RoPE the same
way. Start from the checkpoint: python -m jaxscale.convert from-hf path/to/Llama-3.1-8B converted/

Plan its memory before launch, on any machine:
  python -m jaxscale.plan --config=configs/llama3_1_8b.py --topology=v5p-128      # needs jaxscale[tpu]
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama3_8b.py")))  # its mesh, batch, optimizer and data
    config.model.update(max_seq_len=131072)
    config.model.rope_scaling.update(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_seq_len=8192)
    return config
