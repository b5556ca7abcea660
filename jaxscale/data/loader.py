"""make_data and Data: a run's training and validation batches as global jax.Arrays.

The training order is a Grain shuffle of all windows, reshuffled every epoch (Grain's shuffle
seeds each epoch with seed+epoch when it sits before repeat()); a mixture shuffles each source
so and picks a source per sample (jaxscale.data.mixture). The whole stream is a pure function of
(data, train.seed, global sample index): the same on any number of devices or processes, so the
checkpointed sample index is the whole data position.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale.data import pairs, sources
from jaxscale.data.batches import Batch, StepBatches, process_rows
from jaxscale.data.mixture import MixtureMap
from jaxscale.data.settings import DataSettings, read_settings
from jaxscale.data.synthetic import synthetic_splits
from jaxscale.data.tokenize import Tokenizer, load_tokenizer
from jaxscale.data.windows import TokenWindows, train_val_windows
from jaxscale.errors import ConfigError

STEPS_AHEAD = 2  # prefetched local batches per read thread


def shuffle_seed(seed: int, name: str = "") -> int:
    """Grain's shuffle seed for train.seed (and a mixture's source `name`).

    Hashed because Grain uses seed+epoch for each epoch: with raw seeds, run seed=1 would
    replay run seed=0's second epoch, correlating runs that should be independent. A source's
    name enters the hash, so adding a source to a mixture leaves the others' orders as they were.
    """
    entropy = [seed, zlib.crc32(name.encode())] if name else seed
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclasses.dataclass
class Split:
    """One source's training and validation windows, and its weight in a mixture."""

    name: str
    train: TokenWindows | Sequence
    val: TokenWindows | Sequence
    weight: float = 1.0
    paired: bool = False  # samples are preference pairs (data.pairs), read as two rows each


def _orders(splits: list[Split], seed: int) -> tuple[grain.MapDataset, grain.MapDataset, MixtureMap | None]:
    """(the training order: shuffled and reshuffled every epoch, the validation order: as stored,
    the mixture map when there are several sources)."""
    if len(splits) == 1:
        train = grain.MapDataset.source(splits[0].train).shuffle(seed=shuffle_seed(seed)).repeat()
        val = grain.MapDataset.source(splits[0].val).repeat()
        if splits[0].paired:  # pairs shuffled whole, then read row by row
            train, val = (grain.MapDataset.source(pairs.Rows(order)) for order in (train, val))
        return train, val, None
    mix = MixtureMap([s.weight for s in splits], shuffle_seed(seed))
    train = [grain.MapDataset.source(s.train).shuffle(seed=shuffle_seed(seed, s.name)).repeat() for s in splits]
    val = [grain.MapDataset.source(s.val).repeat() for s in splits]
    return (grain.MapDataset.select_from_datasets(train, mix), grain.MapDataset.select_from_datasets(val, mix),
            mix)


class Data:
    """Training and validation batches, each {'inputs','targets'} (+ 'segments' with
    data.document_mask): int32 [B, L] with the batch sharding."""

    def __init__(self, splits: list[Split], tokenizer: Tokenizer, sharding: NamedSharding, settings: DataSettings,
                 notes: tuple[str, ...] = ()):
        self.tokenizer, self.sharding, self.splits, self.notes = tokenizer, sharding, splits, notes
        self.num_train_tokens = sum(_tokens(s.train, settings.seq_len) for s in splits)
        self.num_val_tokens = sum(_tokens(s.val, settings.seq_len) for s in splits)
        self.global_shape = (settings.global_batch, settings.seq_len)
        self._threads = settings.num_threads
        self.rows = rows = process_rows(sharding, self.global_shape)  # this process's rows of every batch
        train, val, self.mixture = _orders(splits, settings.seed)
        self._train = StepBatches(train, settings.global_batch, rows)
        self._val = StepBatches(val, settings.global_batch, rows)

    @property
    def keys(self) -> tuple[str, ...]:
        """The arrays of every batch: inputs and targets, and segments (data.document_mask) and
        mask (chat data) where they come."""
        return tuple(self.splits[0].train[0])

    def identity(self) -> dict:
        """What a checkpoint records of the data beside its position: each source's name, weight
        and training windows (a resume on other data is told so)."""
        return {"sources": [{"name": s.name, "weight": s.weight, "windows": len(s.train)} for s in self.splits]}

    def stats(self, step: int) -> dict[str, float]:
        """For a mixture, after `step` steps: each source's realised share of the samples read
        (mix_NAME) and the epochs of it read (epochs_NAME)."""
        if self.mixture is None:
            return {}
        taken = self.mixture.taken(step * self.global_shape[0])
        share = taken / max(int(taken.sum()), 1)
        return {**{f"mix_{s.name}": float(f) for s, f in zip(self.splits, share)},
                **{f"epochs_{s.name}": int(n) / len(s.train) for s, n in zip(self.splits, taken)}}

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


def _tokens(windows, seq_len: int) -> int:
    return windows.tokens if isinstance(windows, TokenWindows | pairs.PairWindows) else len(windows) * seq_len


def _split(source: sources.Source, s: DataSettings, eos_id: int | None, masked: bool = False) -> Split:
    if source.pairs is not None:
        return Split(source.name, *pairs.split(*source.pairs, s.val_fraction, eos_id), source.weight, paired=True)
    train, val = train_val_windows(source.pieces, s.seq_len, s.val_fraction, eos_id,
                                   name=source.name if s.mixture else "", masks=source.masks, masked=masked)
    return Split(source.name, train, val, source.weight)


def _file_splits(s: DataSettings, tokenizer: Tokenizer) -> tuple[list[Split], tuple[str, ...]]:
    named = [(*entry, "data.mixture") for entry in s.mixture] or [("data", s.path, 1.0, "data.path")]
    loaded = [sources.load(name, path, s, tokenizer, field, weight) for name, path, weight, field in named]
    eos_id = tokenizer.eos_id if s.document_mask else None
    encoded = sum(source.encoded_bytes for source in loaded)
    notes = (sources.PREPARE_NOTE.format(mib=encoded / 2**20, files="text files are"),) if encoded else ()
    masked = any(source.masks is not None for source in loaded)  # then every batch carries a mask
    if len(loaded) > 1 and any(source.pairs is not None for source in loaded):
        raise ConfigError("data.mixture", s.mixture[0][1], "preference pairs are read from one source; "
                          "set data.path (several files or a glob may name them)")
    return ([_split(source, s, eos_id, masked) for source in loaded],
            notes + _mixture_notes(loaded, s) + _mask_notes(loaded, s))


def _mask_notes(loaded: list[sources.Source], s: DataSettings) -> tuple[str, ...]:
    if loaded[0].pairs is not None:
        tokens, mask = loaded[0].pairs
        return (f"preference data: {len(tokens):,} pairs, {int(mask.sum()):,} of {mask.size:,} tokens in their "
                "completions; a batch holds pair i as rows 2i (chosen) and 2i+1 (rejected)",)
    masks = [mask for source in loaded for mask in source.masks or ()]
    if not masks:
        return ()
    trained, total = sum(int(m.sum()) for m in masks), sum(len(m) for m in masks)
    return (f"chat data: {trained:,} of {total:,} tokens trained (data.train_on={s.train_on}); the loss is the mean "
            "over the trained tokens of each global batch, logged as trained_tokens",)


def _mixture_notes(loaded: list[sources.Source], s: DataSettings) -> tuple[str, ...]:
    if not s.mixture:
        return ()
    total = sum(source.weight for source in loaded)
    return ("data mixture: " + ", ".join(f"{source.name} {source.weight / total:.3f}" for source in loaded)
            + f" of each batch (seeded by train.seed={s.seed}); realised shares and epochs are logged as "
            "mix_NAME and epochs_NAME",)


def make_data(config, batch_sharding: NamedSharding) -> Data:
    """The run's data as config.data says; every bad input raises ConfigError naming its field.

    batch_sharding is the sharding of a global [train.global_batch_size, train.seq_len] batch;
    this process reads only the rows its devices hold.
    """
    settings = read_settings(config)
    # Pre-tokenized and synthetic data skip the tokenizer; it is still loaded for decoding samples.
    tokenizer = load_tokenizer(settings.tokenizer)
    if settings.source == "file":
        splits, notes = _file_splits(settings, tokenizer)
        return Data(splits, tokenizer, batch_sharding, settings, notes)
    if settings.source == "embedded":
        source = sources.embedded(settings, tokenizer)
        eos_id = tokenizer.eos_id if settings.document_mask else None
        return Data([_split(source, settings, eos_id)], tokenizer, batch_sharding, settings)
    train, val = synthetic_splits(settings.vocab_size, settings.seq_len, settings.seed, settings.document_mask)
    return Data([Split("synthetic", train, val)], tokenizer, batch_sharding, settings)
