"""What changes while a run trains, held in one place: the TrainState, the data position and the
loop's counters. The Run (jaxscale.build) is fixed; this is the rest."""

from __future__ import annotations

import dataclasses

import jax

from jaxscale.state import TrainState


@dataclasses.dataclass
class RunState:
    """Everything that changes while a run trains, in one place."""

    state: TrainState
    data_step: int = 0          # index of the next training batch (ahead of state.step after a rollback)
    rollbacks: int = 0
    productive_s: float = 0.0   # device step time of every step so far: goodput's numerator

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))


