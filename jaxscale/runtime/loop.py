"""The training loop: stretches of steps, each step running the hooks of jaxscale.runtime.hooks in order.

    with open_session(config, workdir) as session:
        records = run_steps(session)          # or train(config, workdir)
"""

from __future__ import annotations

from pathlib import Path

from jaxscale.runtime import hooks
from jaxscale.runtime.hooks import Clock, Outcome, Stretch, UserHook
from jaxscale.runtime.session import Session, open_session


def run_steps(session: Session, until: int | None = None, user_hooks: tuple[UserHook, ...] = ()) -> list[dict]:
    """Train from the state's step to train.steps (or `until`), saving when due and at the last
    step run, calling `user_hooks` after the steps they ask for; returns the logged records.
    Stops early, after saving, when preempted."""
    last, records = min(session.run.config.train.steps, until or session.run.config.train.steps), []
    session.compiled()
    services = session.services
    # Signals are taken over only while steps run: outside them (a notebook between calls)
    # Ctrl-C keeps its usual meaning.
    with services.preemption:
        services.watchdog.start()
        try:
            while session.live.step < last and _stretch(session, last, records, user_hooks) == Outcome.ROLLBACK:
                pass
        finally:
            services.watchdog.stop()
    services.checkpointer.wait()  # the report names the last committed checkpoint
    session.report(final=True)
    return records


def _stretch(session: Session, last: int, records: list[dict], user_hooks: tuple[UserHook, ...] = ()) -> Outcome:
    """Steps from the state's step to `last` (hooks.run_step for each)."""
    start = session.live.step
    stretch = Stretch(last, session.data.train_batches(session.live.data_step), Clock(start), records)
    try:
        for step in range(start + 1, last + 1):
            outcome = hooks.run_step(session, stretch, step, user_hooks)
            if outcome is not None:
                return outcome
        return Outcome.DONE
    finally:
        stretch.batches.close()
        session.services.trace.stop(session.live.state)


def evaluate(session: Session) -> float:
    """Mean loss over the held-out batches (train.eval_batches of them)."""
    return hooks.eval_metrics(session)["loss"]


def train(config, workdir: str | Path, show_progress: bool = True, until: int | None = None,
          devices=None) -> list[dict]:
    """Train as the config says (on all devices, or the given ones), writing config.json,
    metrics.jsonl, TensorBoard events and checkpoints; the same call on the same workdir resumes
    from the latest committed checkpoint. `until` stops after that step (call again to go on).
    SIGTERM/SIGINT stop after the step in flight with a checkpoint of it."""
    with open_session(config, workdir, show_progress, devices) as session:
        return run_steps(session, until)
