"""The per-step concerns of the training loop, one small hook each, run in a fixed order (HOOKS).

A hook takes the session and the stretch of steps being run, reads or fills in the current
step's fields, and returns None to go on or an Outcome to end the stretch. Step time is taken
once the step's results are on the host (JAX dispatches asynchronously), so a logged window
measures the devices' work, not how fast steps were queued.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jaxscale import metrics as metrics_lib
from jaxscale.session import Session


class Outcome(enum.Enum):
    DONE = "done"                # reached the last step of the stretch
    PREEMPTED = "preempted"      # SIGTERM/SIGINT: the step in flight was saved and committed
    ROLLBACK = "rollback"        # a loss spike reloaded an earlier checkpoint: start a new stretch


class Clock:
    """Wall time per step between logged steps, split into waiting for the batch, blocking on
    checkpoint saves, and the rest (the device step)."""

    def __init__(self, step: int):
        self.step, self.time = step, time.perf_counter()
        self.data = self.save = 0.0

    def lap(self, step: int) -> dict:
        """The window since the last lap; call it once the window's last results are on the host."""
        now = time.perf_counter()
        n = max(step - self.step, 1)
        per_step, data, save = (now - self.time) / n, self.data / n, self.save / n
        self.step, self.time, self.data, self.save = step, now, 0.0, 0.0
        return {"step_time_s": per_step, "data_wait_s": data, "checkpoint_block_s": save,
                "device_step_s": max(per_step - data - save, 0.0)}

    def restart(self) -> None:
        """Start the window afresh (what came before, e.g. an evaluation, is not step time)."""
        self.time = time.perf_counter()


@dataclasses.dataclass
class Stretch:
    """Consecutive steps run with one batch iterator, and the current step's fields."""

    last: int                    # the stretch ends after this step
    batches: Iterator
    clock: Clock
    records: list[dict]          # the logged records, appended to as steps are logged
    step: int = 0
    batch: dict | None = None
    fed_s: float = 0.0           # this host's time getting the batch onto its devices
    metrics: dict | None = None  # the step's metrics: device arrays, then host values when logged
    stop: bool = False           # preemption reached: save this step and stop
    record: dict | None = None   # the logged record of this step, if it is logged


def feed(session: Session, s: Stretch) -> None:
    session.services.trace.before(s.step)
    began = time.perf_counter()
    s.batch = next(s.batches)
    s.fed_s = time.perf_counter() - began  # waiting for the devices is not counted: put is async
    s.clock.data += s.fed_s


def train(session: Session, s: Stretch) -> None:
    live = session.live
    live.state, s.metrics = session.compiled()(live.state, s.batch)
    live.data_step += 1


def watchdog(session: Session, s: Stretch) -> None:
    session.services.watchdog.beat(s.step)


def stragglers(session: Session, s: Stretch) -> None:
    session.services.stragglers.add(s.step, s.fed_s, session.live.state)


def tracing(session: Session, s: Stretch) -> None:
    session.services.trace.after(s.step, session.live.state)


def preemption(session: Session, s: Stretch) -> None:
    s.stop = session.services.preemption.reached(s.step)


def checkpoint(session: Session, s: Stretch) -> None:
    """A persistent save when due (and at the last step or a stop), else a local one when due."""
    persistent = s.stop or s.step == s.last or session.services.checkpointer.due(s.step)
    local = session.services.local
    if persistent or (local is not None and local.due(s.step)):
        jax.block_until_ready(session.live.state)  # finishing the queued steps is step time, not saving
        began = time.perf_counter()
        if persistent:
            session.save(s.step)
        else:
            local.save(s.step, session.live.state, session.position())
        s.clock.save += time.perf_counter() - began


def rollback(session: Session, s: Stretch) -> Outcome | None:
    """With guard.spike_action=rollback, reload the newest checkpoint before a loss spike."""
    if session.run.guard.spike_action != "rollback" or not bool(s.metrics["spike"]):
        return None
    return Outcome.ROLLBACK if _roll_back(session, s.step) else None


def measure(session: Session, s: Stretch) -> None:
    """On a logged step: fetch the metrics, then close the clock's window (in that order)."""
    t = session.run.config.train
    if not (s.stop or is_log_step(s.step, t)):
        return
    s.metrics = jax.device_get(s.metrics)
    steps, timing = s.step - s.clock.step, s.clock.lap(s.step)
    live = session.live
    live.productive_s += timing["device_step_s"] * steps
    s.record = _record(session, s, timing)
    s.record.update(goodput=live.productive_s / (time.perf_counter() - session.opened), compile_s=session.compile_s)


def evaluate(session: Session, s: Stretch) -> None:
    if s.record is not None and is_eval_step(s.step, session.run.config.train):
        s.record["val_loss"] = mean_eval_loss(session)


def log(session: Session, s: Stretch) -> None:
    if s.record is None:
        return
    services = session.services
    services.checkpointer.check()  # a background save that failed stops the run here
    services.display.update(s.record)  # the line first: a tracker's first write can take a while
    services.tracker.write(s.record)
    s.records.append(s.record)
    if "val_loss" in s.record:
        if s.step < s.last:  # at the stretch's last step the final report follows at once
            session.report()
        s.clock.restart()  # the evaluation and the report are not step time


def stop(session: Session, s: Stretch) -> Outcome | None:
    """After a preemption signal: wait for this step's checkpoint to commit, then stop."""
    if not s.stop:
        return None
    session.services.watchdog.stop()  # the commit wait has its own deadline
    _finish_preemption(session, s.step)
    return Outcome.PREEMPTED


HOOKS: tuple[Callable[[Session, Stretch], Outcome | None], ...] = (
    feed, train, watchdog, stragglers, tracing, preemption, checkpoint, rollback, measure, evaluate, log, stop)


def is_log_step(step: int, train_cfg) -> bool:
    return step == 1 or step == train_cfg.steps or step % train_cfg.log_every == 0 or is_eval_step(step, train_cfg)


def is_eval_step(step: int, train_cfg) -> bool:
    every = train_cfg.eval_every
    return bool(every) and (step % every == 0 or step == train_cfg.steps)


def mean_eval_loss(session: Session) -> float:
    """Mean loss over the validation batches."""
    params, step = session.live.state.params, session.run.eval_step
    return float(np.mean([jax.device_get(step(params, b)) for b in session.val_batches()]))


def _record(session: Session, s: Stretch, timing: dict) -> dict:
    run, m = session.run, s.metrics
    tokens_per_sec = float(m["tokens"]) / timing["step_time_s"]
    return {"step": s.step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
            "tokens": session.live.data_step * int(m["tokens"]), "tokens_per_sec": tokens_per_sec, **timing,
            "mfu": metrics_lib.mfu(tokens_per_sec, run.flops_per_token, run.layout.mesh.size, run.peak_tflops),
            "nonfinite_skips": int(m["nonfinite_skips"]), "spike_skips": int(m["spike_skips"]),
            **{name: np.asarray(m[name]).tolist() for name in run.model.stat_shapes if name in m},
            **session.data.stats(session.live.data_step)}


def _roll_back(session: Session, step: int) -> bool:
    """Reload the newest checkpoint before a loss spike at `step` and continue with the batches
    after the spike; False (the spike's update stays skipped) when there is none."""
    checkpointer, say, live = session.services.checkpointer, session.services.display.print, session.live
    checkpointer.wait()
    restored = checkpointer.restore(live.state, step=None, before=step, warn=say)
    if restored is None:
        say(f"warning: loss spike at step {step}; no checkpoint before it to roll back to, its update was skipped")
        return False
    live.state, live.rollbacks = restored.state, live.rollbacks + 1
    checkpointer.discard_after(restored.step)  # the abandoned trajectory's saves
    if session.services.local is not None:
        session.services.local.discard(keep=lambda kept: kept <= restored.step)
    skipped = live.data_step - restored.position["global_sample"] // session.run.config.train.global_batch_size
    say(f"rollback: loss spike at step {step}; restored step {restored.step} and skip the {skipped} batches "
        f"trained on since it (next batch: {live.data_step})")
    return True


def _finish_preemption(session: Session, step: int) -> None:
    """Wait for the checkpoint of `step` to commit, within the configured time."""
    watch, say = session.services.preemption, session.services.display.print
    say(f"{watch.signal_name}: stopping after step {step}; saving it (at most {watch.timeout_s:.0f}s after the signal)")
    watch.start_deadline(lambda: _expire(session))
    session.services.checkpointer.wait()
    say(f"checkpoint of step {step} committed {watch.elapsed():.1f}s after {watch.signal_name}; "
        "run the same command to resume")


def _expire(session: Session) -> None:
    latest = session.services.checkpointer.latest_step()
    print(f"jaxscale: error: the checkpoint did not commit within checkpoint.preemption_timeout_s="
          f"{session.services.preemption.timeout_s}; exiting without it (step {latest} is the latest committed)",
          file=sys.stderr, flush=True)
    os._exit(1)
