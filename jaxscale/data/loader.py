"""Global batches: a deterministic sample order, each process reading only its own rows.

Step s uses global samples s*B ... s*B+B-1 of a Grain-shuffled stream (reshuffled each epoch),
so the data is a pure function of (source, seed): independent of device and process count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale.data import sources
from jaxscale.data.tokenize import ByteTokenizer, load_tokenizer
from jaxscale.data.windows import SyntheticWindows, TokenWindows, split
from jaxscale.errors import ConfigError

Batch = dict[str, np.ndarray]


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous rows of a global [B, ...] array that this process's devices hold."""
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    starts = sorted({(i[0].start or 0, global_shape[0] if i[0].stop is None else i[0].stop) for i in indices})
    merged_stop = starts[0][0]
    for start, stop in starts:
        assert start <= merged_stop, f"this process's batch rows are not contiguous: {starts}"
        merged_stop = max(merged_stop, stop)
    return slice(starts[0][0], merged_stop)


class _LocalBatches(Sequence):
    """Random access: step -> this process's rows of that step's global batch."""

    def __init__(self, samples: grain.MapDataset, global_batch: int, rows: slice):
        self.samples, self.global_batch, self.rows = samples, global_batch, rows

    def __len__(self) -> int:
        return len(self.samples) // self.global_batch

    def __getitem__(self, step: int) -> Batch:
        first = step * self.global_batch
        examples = [self.samples[first + r] for r in range(self.rows.start, self.rows.stop)]
        return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


class Data:
    """Training and validation batches as global jax.Arrays with the batch sharding."""

    def __init__(self, train: Sequence, val: Sequence, tokenizer, config, sharding: NamedSharding,
                 num_train_tokens: int, num_val_tokens: int):
        t = config.train
        self.tokenizer, self.sharding = tokenizer, sharding
        self.num_train_tokens, self.num_val_tokens = num_train_tokens, num_val_tokens
        self.global_shape = (t.global_batch_size, t.seq_len)
        self._threads = config.data.num_threads
        rows = process_rows(sharding, self.global_shape)
        shuffled = grain.MapDataset.source(train).shuffle(seed=t.seed).repeat()
        self._train = _LocalBatches(shuffled, t.global_batch_size, rows)
        self._val = _LocalBatches(grain.MapDataset.source(val).repeat(), t.global_batch_size, rows)

    def local_batch(self, step: int) -> Batch:
        """This process's rows of step's training batch (numpy)."""
        return self._train[step]

    def _to_global(self, local: Batch) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.sharding, v, self.global_shape)
                for k, v in local.items()}

    def train_batches(self, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """Global batches for steps start_step, start_step+1, ...; read ahead by Grain threads."""
        steps = grain.MapDataset.source(self._train)[start_step:]
        options = grain.ReadOptions(num_threads=self._threads, prefetch_buffer_size=2 * self._threads)
        return map(self._to_global, steps.to_iter_dataset(options))

    def val_batches(self, num_batches: int) -> list[dict[str, jax.Array]]:
        """The first num_batches validation batches, in order, the same at every evaluation."""
        return [self._to_global(self._val[i]) for i in range(num_batches)]


def _token_stream(data_cfg, tokenizer) -> np.ndarray:
    source = data_cfg.source if data_cfg.source != "auto" else ("file" if data_cfg.path else "embedded")
    if source == "embedded":
        return sources.encode_documents(sources.embedded_documents(), tokenizer)
    path = sources.check_path(data_cfg.path)
    if path.suffix in sources.TOKEN_SUFFIXES:
        return sources.token_file(path, data_cfg.token_dtype)
    return sources.encode_documents(sources.file_documents(path, data_cfg.text_field), tokenizer)


def _check_vocab(tokens: np.ndarray, tokenizer, vocab_size: int, pretokenized: bool) -> None:
    largest = sources.max_token(tokens) if pretokenized else tokenizer.vocab_size - 1
    if largest >= vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"the data has token ids up to {largest}; use at least {largest + 1}")


def _windows(config, tokenizer) -> tuple[Sequence, Sequence, int, int]:
    t = config.train
    if config.data.source == "synthetic":
        return (SyntheticWindows(config.model.vocab_size, t.seq_len, t.seed),
                SyntheticWindows(config.model.vocab_size, t.seq_len, t.seed + 1, count=1 << 12), 0, 0)
    tokens = _token_stream(config.data, tokenizer)
    pretokenized = config.data.path.endswith(sources.TOKEN_SUFFIXES)
    _check_vocab(tokens, tokenizer, config.model.vocab_size, pretokenized)
    train, val = split(tokens, config.data.val_fraction)
    for name, part in (("training", train), ("validation", val)):
        if len(part) <= t.seq_len:
            raise ConfigError("train.seq_len", t.seq_len, f"the {name} split has only {len(part)} tokens; use more data or a shorter seq_len")
    return TokenWindows(train, t.seq_len), TokenWindows(val, t.seq_len), len(train), len(val)


def make_data(config, batch_sharding: NamedSharding) -> Data:
    """The run's data, as config.data says; bad input raises ConfigError naming the field."""
    pretokenized = config.data.path.endswith(sources.TOKEN_SUFFIXES) or config.data.source == "synthetic"
    tokenizer = ByteTokenizer() if pretokenized and config.data.tokenizer == "bytes" else load_tokenizer(config.data.tokenizer)
    train, val, n_train, n_val = _windows(config, tokenizer)
    return Data(train, val, tokenizer, config, batch_sharding, n_train, n_val)
