"""Mixtures: which source each global sample comes from, and its index within that source.

Samples come in blocks of about 1,000: a block holds each source's share of the weights
(rounded by largest remainder, at least one each) in an order drawn from the run's seed and the
block's number. So proportions are exact at every block's end and off by under a block anywhere
else, where independent draws would wander by sqrt(n); the order still looks random; and a
sample's source is a pure function of (seed, index), the same on any number of processes and
cheap to find at any step, which is what exact resume needs. Each source repeats on its own:
source k's j-th sample is window j of its shuffled, endlessly repeated windows, so each source
runs through its own epochs.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

BLOCK = 1000


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Samples of each source per block: weights scaled to `block`, largest remainders rounded up,
    at least one each (so the block may grow past `block` for tiny weights)."""
    share = np.asarray(weights, np.float64) / np.sum(weights) * block
    counts = np.floor(share).astype(np.int64)
    for k in np.argsort(-(share - counts), kind="stable")[:block - counts.sum()]:
        counts[k] += 1
    return np.maximum(counts, 1)


class MixtureMap(grain.transforms.DatasetSelectionMap):
    """Global sample index -> (source, index within the source), for Grain's select_from_datasets."""

    def __init__(self, weights: list[float], seed: int):
        self.counts, self.seed = block_counts(weights), seed
        self.block = int(self.counts.sum())
        self._cache = (-1, None, None)  # the last block's layout: samples come in order

    def __len__(self) -> int:
        return sys.maxsize  # the sources repeat without end

    def _layout(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position in block `number`, its rank among that source's positions)."""
        cached, sources, rank = self._cache
        if cached != number:
            rng = np.random.default_rng([self.seed, number])
            sources = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            order = np.argsort(sources, kind="stable")
            rank = np.empty(self.block, np.int64)
            rank[order] = np.arange(self.block) - np.repeat(np.cumsum(self.counts) - self.counts, self.counts)
            self._cache = (number, sources, rank)
        return sources, rank

    def __getitem__(self, index: int) -> tuple[int, int]:
        number, position = divmod(index, self.block)
        sources, rank = self._layout(number)
        source = int(sources[position])
        return source, number * int(self.counts[source]) + int(rank[position])

    def taken(self, samples: int) -> np.ndarray:
        """How many of the first `samples` samples each source gave."""
        number, position = divmod(samples, self.block)
        return number * self.counts + np.bincount(self._layout(number)[0][:position], minlength=len(self.counts))
