"""Step timing is taken once a step's results are on the host.

JAX dispatches asynchronously: calling the compiled step returns at once and the results are
ready later. The step here stands in for a slow device: every call returns at once, and its
metrics become readable only when a simulated device, working through the queued steps one at a
time, has spent SECONDS on each. The logged step time of every window, the first after
compilation and the first after an evaluation included, must then be that per-step time.
"""

import threading
import time

import jax
import numpy as np
import pytest

from jaxscale.runtime import session as session_lib
from jaxscale.runtime.loop import train

SECONDS = 0.3  # the simulated device's time per step; sleeping, so a loaded machine does not change it


class _Pending:
    """A metric that can be read only once the simulated device has finished its step."""

    def __init__(self, value, ready_at: float):
        self.value, self.ready_at = value, ready_at

    def __array__(self, dtype=None, copy=None):
        time.sleep(max(self.ready_at - time.monotonic(), 0.0))
        return np.asarray(self.value, dtype)


class _SlowDevice:
    """(state, batch) -> (state, metrics) that returns at once; step i is done SECONDS after step i-1."""

    def __init__(self):
        self.free_at, self.lock = 0.0, threading.Lock()

    def __call__(self, state, batch):
        with self.lock:
            self.free_at = max(time.monotonic(), self.free_at) + SECONDS
        metrics = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": batch["targets"].size, "spike": False,
                   "nonfinite_skips": 0, "spike_skips": 0}
        return state, {k: _Pending(v, self.free_at) for k, v in metrics.items()}


def test_every_window_measures_the_steps_not_their_dispatch(tiny_config, tmp_path, monkeypatch):
    device = _SlowDevice()
    monkeypatch.setattr(session_lib.Session, "compiled", lambda self: device)
    # windows: 1 | 2-4 | 5-8, evaluation | 9-12 | 13-16 and the final save (not checked: saving overlaps the device)
    tiny_config.train.update(steps=16, log_every=4, eval_every=8)
    tiny_config.checkpoint.every_steps = 0
    records = train(tiny_config, tmp_path, show_progress=False, devices=jax.devices()[:1])
    device_s = {r["step"]: r["device_step_s"] for r in records if r["step"] < 16}
    assert sorted(device_s) == [1, 4, 8, 12]
    # step 1 is the first window after compilation, 9-12 the first after an evaluation; the time
    # waiting for batches is reported apart (data_wait_s), so the device's share is what is left
    for step, seconds in device_s.items():
        assert seconds == pytest.approx(SECONDS, rel=0.1), (step, device_s)
