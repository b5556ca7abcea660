"""Hugging Face safetensors checkpoints on disk: one file or shards with an index.

Reading goes tensor by tensor (or part of a tensor) through `safe_open`, so the host never
holds more than the tensor being read; writing goes shard by shard.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import ml_dtypes  # noqa: F401  registers numpy's 'bfloat16' dtype, which safetensors' numpy reader needs
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxscale.errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointReader(contextlib.ExitStack):
    """The tensors of an HF checkpoint directory, by name; use as a context manager."""

    def __init__(self, hf_dir):
        super().__init__()
        self.dir = Path(hf_dir)
        self.files = _weight_map(self.dir)  # tensor name -> file name
        self._open: dict[str, object] = {}

    def _file(self, name: str):
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self.enter_context(safe_open(str(self.dir / file), framework="numpy"))
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, axis: int = 0, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The tensor, or only its [start:stop] range along `axis` (read from disk as such), in the
        checkpoint's dtype (hf_names.to_ours converts it as it lays it out: one float32 copy)."""
        if start is None:
            return self._file(name).get_tensor(name)
        view = self._file(name).get_slice(name)
        index = [slice(None)] * len(view.get_shape())
        index[axis] = slice(start, stop)
        return view[tuple(index)]


def _weight_map(hf_dir: Path) -> dict[str, str]:
    if (hf_dir / INDEX).is_file():
        return json.loads((hf_dir / INDEX).read_text())["weight_map"]
    if (hf_dir / SINGLE).is_file():
        with safe_open(str(hf_dir / SINGLE), framework="numpy") as f:
            return {name: SINGLE for name in f.keys()}
    raise ConfigError("hf_dir", str(hf_dir), f"has neither {SINGLE} nor {INDEX}; save the model with "
                                             "save_pretrained(dir, safe_serialization=True)")


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(count: int) -> list[str]:
    """HF's names: model.safetensors alone, else model-0000k-of-0000n.safetensors."""
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    # transformers refuses safetensors files whose metadata does not name the format.
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(out_dir: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
