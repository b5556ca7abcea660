"""DPO on preference pairs for Llama-3.2-1B (configs/sft_llama_1b.py's settings), on one GPU.

The reference is the model the run starts from: with LoRA, the frozen base with the adapters off
(docs/finetuning.md). Start from a model already instruction-tuned (a Hugging Face directory,
e.g. an SFT run's merged export):

  python -m jaxscale.train --config=configs/dpo_llama_1b.py --config.data.path=pairs.jsonl \
      --config.checkpoint.init_from=path/to/Llama-3.2-1B-Instruct --workdir=runs/dpo_llama_1b
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("sft_llama_1b.py")))
    config.preference.update(loss="dpo", beta=0.1)
    config.train.update(steps=500, global_batch_size=16, seq_len=1024)  # 8 pairs a step
    config.optim.update(lr=5e-5, warmup_steps=20)  # adapters take larger steps than TRL DPO's 1e-6 for all weights
    config.data.update(path="pairs.jsonl")
    return config
