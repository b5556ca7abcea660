"""Instruction-tune Llama-3.2-1B (configs/llama_1b.py) on chat records with LoRA adapters, on one GPU.

The loss trains the assistant's turns (data.train_on=assistant), rendered by the tokenizer's own
chat template; adapters of rank 16 on every projection, over a bfloat16 base (docs/finetuning.md):

  python -m jaxscale.train --config=configs/sft_llama_1b.py --config.data.path=chats.jsonl \
      --config.checkpoint.init_from=path/to/Llama-3.2-1B-Instruct --workdir=runs/sft_llama_1b
  python -m jaxscale.convert to-hf runs/sft_llama_1b adapters/ --peft
"""

from pathlib import Path

from jaxscale.config import load


def get_config():
    config = load(str(Path(__file__).with_name("llama_1b.py")))
    config.model.lora.update(rank=16, alpha=32.0, base_dtype="bfloat16")
    config.train.update(steps=1000, global_batch_size=16, seq_len=2048, log_every=10, eval_every=100)
    config.optim.update(lr=2e-4, warmup_steps=30, weight_decay=0.0, min_lr_ratio=0.1)
    config.data.update(source="file", path="chats.jsonl", train_on="assistant")
    config.checkpoint.update(every_steps=200)
    return config
