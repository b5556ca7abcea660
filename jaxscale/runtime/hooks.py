"""The per-step concerns of the training loop, one small function each, run in the fixed order
`run_step` states, each given what it needs and returning what it measured: nothing is passed
through a shared record. Users add their own (`UserHook`, `Trainer.add_hook(fn, every=N)`),
called after the built-in ones with a `StepInfo`.

Step time is taken once the step's results are on the host (JAX dispatches asynchronously), so a
logged window measures the devices' work, not how fast steps were queued.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxscale import state as state_lib
from jaxscale.analysis import mfu
from jaxscale.runtime.session import Session


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


@dataclasses.dataclass(frozen=True)
class Stretch:
    """Consecutive steps run with one batch iterator: what the loop owns across them."""

    last: int                    # the stretch ends after this step
    batches: Iterator
    clock: Clock
    records: list[dict]          # the logged records, appended to as steps are logged


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a user hook sees after a step: its number, the state after it, the step's metrics
    (device arrays: reading one waits for the step) and its logged record (None unless logged)."""

    step: int
    state: Any
    metrics: dict
    record: dict | None


@dataclasses.dataclass(frozen=True)
class UserHook:
    """fn(StepInfo) after every `every`-th step (its return value is ignored)."""

    fn: Callable[[StepInfo], object]
    every: int = 1


def run_step(session: Session, s: Stretch, step: int, user_hooks: tuple[UserHook, ...] = ()) -> Outcome | None:
    """One step and everything that comes with it, in order; an Outcome ends the stretch."""
    batch, fed_s = feed(session, s.clock, step, s.batches)
    metrics = take_step(session, batch)
    watch(session, step, fed_s)
    stopping = session.services.preemption.reached(step)
    checkpoint(session, s.clock, step, stopping or step == s.last)
    if rollback(session, step, metrics):
        return Outcome.ROLLBACK
    record = measure(session, s.clock, step, stopping, metrics)
    if record is not None:
        record = with_val_loss(session, step, record)
        log(session, s, step, record)
    for hook in user_hooks:
        if step % hook.every == 0:
            hook.fn(StepInfo(step, session.live.state, metrics, record))
    return stop(session, step) if stopping else None


def feed(session: Session, clock: Clock, step: int, batches: Iterator) -> tuple[dict, float]:
    """(the step's batch, this host's time getting it onto its devices): waiting for the devices
    is not counted, put is asynchronous."""
    session.services.trace.before(step)
    began = time.perf_counter()
    batch = next(batches)
    fed_s = time.perf_counter() - began
    clock.data += fed_s
    return batch, fed_s


def take_step(session: Session, batch: dict) -> dict:
    """The step on the live state; returns its metrics (device arrays)."""
    live = session.live
    live.state, metrics = session.compiled()(live.state, batch)
    live.data_step += 1
    return metrics


def watch(session: Session, step: int, fed_s: float) -> None:
    """The watchdog's heartbeat, the straggler report's sample and the profiler window."""
    services = session.services
    services.watchdog.beat(step)
    services.stragglers.add(step, fed_s, session.live.state)
    services.trace.after(step, session.live.state)


def checkpoint(session: Session, clock: Clock, step: int, final: bool) -> None:
    """A persistent save when due (and at a `final` step: the stretch's last, or a stop), else a
    local one when due; the time it blocks goes to the clock."""
    persistent = final or session.services.checkpointer.due(step)
    local = session.services.local
    if persistent or (local is not None and local.due(step)):
        jax.block_until_ready(session.live.state)  # finishing the queued steps is step time, not saving
        began = time.perf_counter()
        if persistent:
            session.save(step)
        else:
            local.save(step, state_lib.changing(session.live.state), session.position())
        clock.save += time.perf_counter() - began


def rollback(session: Session, step: int, metrics: dict) -> bool:
    """With guard.spike_action=rollback, reload the newest checkpoint before a loss spike."""
    if session.run.guard.spike_action != "rollback" or not bool(metrics["spike"]):
        return False
    return _roll_back(session, step)


def measure(session: Session, clock: Clock, step: int, stopping: bool, metrics: dict) -> dict | None:
    """On a logged step: the record (metrics fetched, then the clock's window closed, in that
    order); None on other steps."""
    t = session.run.config.train
    if not (stopping or is_log_step(step, t)):
        return None
    metrics = jax.device_get(metrics)
    steps, timing = step - clock.step, clock.lap(step)
    live = session.live
    live.productive_s += timing["device_step_s"] * steps
    record = _record(session, step, metrics, timing)
    record.update(goodput=live.productive_s / (time.perf_counter() - session.opened), compile_s=session.compile_s)
    return record


def with_val_loss(session: Session, step: int, record: dict) -> dict:
    """The record, with the validation loss on an evaluation step (and under preference tuning
    the held-out pairs' rewards: val_reward_accuracy, ...)."""
    if is_eval_step(step, session.run.config.train):
        means = eval_metrics(session)
        return {**record, "val_loss": means.pop("loss"), **{f"val_{name}": value for name, value in means.items()}}
    return record


def log(session: Session, s: Stretch, step: int, record: dict) -> None:
    """The record to the console and the trackers (after an evaluation, the run report)."""
    services = session.services
    services.checkpointer.check()  # a background save that failed stops the run here
    services.display.update(record)  # the line first: a tracker's first write can take a while
    services.tracker.write(record)
    s.records.append(record)
    if "val_loss" in record:
        if step < s.last:  # at the stretch's last step the final report follows at once
            session.report()
        s.clock.restart()  # the evaluation and the report are not step time


def stop(session: Session, step: int) -> Outcome:
    """After a preemption signal: wait for this step's checkpoint to commit, then stop."""
    session.services.watchdog.stop()  # the commit wait has its own deadline
    _finish_preemption(session, step)
    return Outcome.PREEMPTED


def is_log_step(step: int, train_cfg) -> bool:
    return step == 1 or step == train_cfg.steps or step % train_cfg.log_every == 0 or is_eval_step(step, train_cfg)


def is_eval_step(step: int, train_cfg) -> bool:
    every = train_cfg.eval_every
    return bool(every) and (step % every == 0 or step == train_cfg.steps)


def eval_metrics(session: Session) -> dict[str, float]:
    """Each metric of the eval step ("loss", and under preference tuning the rewards) averaged over
    the validation batches."""
    state, step = session.live.state, session.run.eval_step
    values = [jax.device_get(step(state.params, state.base, b)) for b in session.val_batches()]
    return {name: float(np.mean([v[name] for v in values])) for name in (values[0] if values else ["loss"])}


def _record(session: Session, step: int, m: dict, timing: dict) -> dict:
    run = session.run
    tokens_per_sec = float(m["tokens"]) / timing["step_time_s"]
    return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
            "tokens": session.live.data_step * int(m["tokens"]), "tokens_per_sec": tokens_per_sec, **timing,
            "mfu": mfu.mfu(tokens_per_sec, run.flops_per_token, run.layout.mesh.size, run.peak_tflops),
            "nonfinite_skips": int(m["nonfinite_skips"]), "spike_skips": int(m["spike_skips"]),
            **{name: np.asarray(m[name]).tolist() for name in run.step_spec.stat_shapes if name in m},
            **_trained(m, timing),
            **session.data.stats(session.live.data_step)}


def _trained(m: dict, timing: dict) -> dict:
    """With a loss mask, the step's trained targets and their rate (tokens and MFU count every
    token the step computed on: the FLOPs it did)."""
    if "trained_tokens" not in m:
        return {}
    trained = int(m["trained_tokens"])
    return {"trained_tokens": trained, "trained_tokens_per_sec": trained / timing["step_time_s"]}


def _roll_back(session: Session, step: int) -> bool:
    """Reload the newest checkpoint before a loss spike at `step` and continue with the batches
    after the spike; False (the spike's update stays skipped) when there is none."""
    checkpointer, say, live = session.services.checkpointer, session.services.display.print, session.live
    checkpointer.wait()
    restored = checkpointer.restore(state_lib.changing(live.state), step=None, before=step, warn=say)
    if restored is None:
        say(f"warning: loss spike at step {step}; no checkpoint before it to roll back to, its update was skipped")
        return False
    live.state, live.rollbacks = dataclasses.replace(restored.state, base=live.state.base), live.rollbacks + 1
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
