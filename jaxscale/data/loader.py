"""make_data and Data: a run's training and validation batches as global jax.Arrays.

The training order is a Grain shuffle of all windows, reshuffled every epoch (Grain's shuffle
seeds each epoch with seed+epoch when it sits before repeat()), so the whole stream is a pure
function of (data, train.seed): the same on any number of devices or processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale.data import sources
from jaxscale.data.batches import Batch, StepBatches, process_rows
from jaxscale.data.settings import DataSettings, read_settings
from jaxscale.data.synthetic import synthetic_splits
from jaxscale.data.tokenize import Tokenizer, load_tokenizer
from jaxscale.data.windows import train_val_windows
from jaxscale.errors import ConfigError

STEPS_AHEAD = 2  # prefetched local batches per read thread


def shuffle_seed(seed: int) -> int:
    """Grain's shuffle seed for train.seed.

    Hashed because Grain uses seed+epoch for each epoch: with raw seeds, run seed=1 would
    replay run seed=0's second epoch, correlating runs that should be independent.
    """
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


class Data:
    """Training and validation batches, each {'inputs','targets'} (+ 'segments' with
    data.document_mask): int32 [B, L] with the batch sharding."""

    def __init__(self, train: Sequence, val: Sequence, tokenizer: Tokenizer, sharding: NamedSharding,
                 settings: DataSettings, num_train_tokens: int, num_val_tokens: int):
        self.tokenizer, self.sharding = tokenizer, sharding
        self.num_train_tokens, self.num_val_tokens = num_train_tokens, num_val_tokens
        self.global_shape = (settings.global_batch, settings.seq_len)
        self._threads = settings.num_threads
        self.rows = rows = process_rows(sharding, self.global_shape)  # this process's rows of every batch
        order = grain.MapDataset.source(train).shuffle(seed=shuffle_seed(settings.seed)).repeat()
        self._train = StepBatches(order, settings.global_batch, rows)
        self._val = StepBatches(grain.MapDataset.source(val).repeat(), settings.global_batch, rows)

    def local_batch(self, step: int) -> Batch:
        """This process's rows of step's training batch (numpy, int32), by random access."""
        return self._train[step]

    def _to_global(self, local: Batch) -> dict[str, jax.Array]:
        # Splits the process's rows over its local devices too.
        return {key: jax.make_array_from_process_local_data(self.sharding, value, self.global_shape)
                for key, value in local.items()}

    def train_batches(self, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """Global batches for steps start_step, start_step+1, ... (endless), read ahead by Grain threads."""
        steps = grain.MapDataset.source(self._train)[start_step:]
        options = grain.ReadOptions(num_threads=self._threads, prefetch_buffer_size=STEPS_AHEAD * self._threads)
        for local in steps.to_iter_dataset(options):
            yield self._to_global(local)

    def val_batches(self, num_batches: int) -> list[dict[str, jax.Array]]:
        """The first num_batches*B validation windows in order (wrapping): the same at every evaluation."""
        return [self._to_global(self._val[i]) for i in range(num_batches)]


def _check_tokenizer_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"the tokenizer has {tokenizer.vocab_size} tokens; "
                          f"set model.vocab_size >= {tokenizer.vocab_size}")


def _check_token_ids(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    low, high = sources.token_range(tokens)
    if low < 0:
        raise ConfigError("data.path", path, f"holds a negative token id ({low}); token ids must be >= 0")
    if high >= vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"{path} has token ids up to {high}; "
                          f"set model.vocab_size >= {high + 1}")


def _token_data(s: DataSettings, tokenizer: Tokenizer, sharding: NamedSharding) -> Data:
    pretokenized = sources.is_pretokenized(s)
    if not pretokenized:  # before encoding, so a mismatch fails fast
        _check_tokenizer_vocab(tokenizer, s.vocab_size)
    tokens = sources.load_tokens(s, tokenizer)
    if pretokenized:
        _check_token_ids(tokens, s.vocab_size, s.path)
    train, val = train_val_windows(tokens, s.seq_len, s.val_fraction, tokenizer.eos_id if s.document_mask else None)
    return Data(train, val, tokenizer, sharding, s, len(train.tokens), len(val.tokens))


def make_data(config, batch_sharding: NamedSharding) -> Data:
    """The run's data as config.data says; every bad input raises ConfigError naming its field.

    batch_sharding is the sharding of a global [train.global_batch_size, train.seq_len] batch;
    this process reads only the rows its devices hold.
    """
    settings = read_settings(config)
    # Pre-tokenized and synthetic data skip the tokenizer; it is still loaded for decoding samples.
    tokenizer = load_tokenizer(settings.tokenizer)
    if settings.source != "synthetic":
        return _token_data(settings, tokenizer, batch_sharding)
    train, val = synthetic_splits(settings.vocab_size, settings.seq_len, settings.seed, settings.document_mask)
    return Data(train, val, tokenizer, batch_sharding, settings,
                len(train) * settings.seq_len, len(val) * settings.seq_len)
