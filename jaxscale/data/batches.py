"""Which samples make up a step's batch, and which of its rows this process reads.

Step s is global samples s*B ... s*B+B-1 of one sample order (B = global batch size). The
order never depends on devices or processes, so every process agrees on the global batch and
reads only the rows its devices hold: no process ever loads another's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.sharding import Sharding

Batch = dict[str, np.ndarray]  # {'inputs', 'targets'}: int32 [rows, seq_len]


def process_rows(sharding: Sharding, global_shape: tuple[int, ...]) -> slice:
    """The rows of a global [B, ...] array that this process's devices hold, as one slice.

    Rows replicated over several local devices count once; the union must be contiguous,
    which holds for a batch split over mesh axes whose devices are grouped by process.
    """
    rows = global_shape[0]
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    spans = sorted({index[0].indices(rows)[:2] for index in indices})
    start, stop = spans[0]
    for span_start, span_stop in spans[1:]:
        assert span_start <= stop, (
            f"this process's devices hold batch rows {spans}, not one contiguous range; order the mesh's "
            "devices so each process's devices are adjacent along the batch axes (jax.make_mesh does)")
        stop = max(stop, span_stop)
    return slice(start, stop)


class StepBatches(Sequence):
    """Random access: step -> this process's rows of that step's global batch, stacked (numpy)."""

    def __init__(self, samples: Sequence, global_batch: int, rows: slice):
        self.samples, self.global_batch, self.rows = samples, global_batch, rows

    def __len__(self) -> int:
        return len(self.samples) // self.global_batch

    def __getitem__(self, step: int) -> Batch:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is outside 0..{len(self) - 1}")
        first = step * self.global_batch
        examples = [self.samples[first + row] for row in range(self.rows.start, self.rows.stop)]
        return {key: np.stack([e[key] for e in examples]) for key in examples[0]}
