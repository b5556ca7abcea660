"""The training loop: build everything from a validated config, then step, log and evaluate."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale import config as config_lib
from jaxscale import inspection
from jaxscale import metrics as metrics_lib
from jaxscale import report as report_lib
from jaxscale import resume
from jaxscale import state as state_lib
from jaxscale import xla_flags
from jaxscale.checkpoint import CHECKPOINTS, Checkpointer
from jaxscale.data import Data, make_data
from jaxscale.distributed import job_description
from jaxscale.errors import ConfigError
from jaxscale.guard import GuardSpec
from jaxscale.health import StragglerReport, Watchdog
from jaxscale.mesh import granule_count
from jaxscale.models import LanguageModel, model_from_config
from jaxscale.offload import OffloadSpec, check_supported, to_device_kind
from jaxscale.optim import make_optimizer
from jaxscale.preemption import PreemptionWatch
from jaxscale.progress import ProgressDisplay
from jaxscale.sharding import Layout, layout_from_config
from jaxscale.step import compute_dtype, jit_eval_step, jit_train_step
from jaxscale.tracing import TraceWindow
from jaxscale.tracking import Tracker
from jaxscale.validate import validate
from jaxscale.workdir import WorkdirLock

VERSIONS = {"jaxscale": version("jaxscale"), "jax": jax.__version__, "orbax": version("orbax-checkpoint")}


@dataclasses.dataclass
class Run:
    """Everything built from the config before the first step."""

    config: object
    layout: Layout
    model: LanguageModel
    tx: object           # the optax optimizer
    guard: GuardSpec
    offload: OffloadSpec
    data: Data
    state: state_lib.TrainState
    shardings: state_lib.TrainState
    notes: list[str]     # one-line explanations of layout adjustments
    train_step: object   # jitted (state, batch) -> (state, metrics)
    eval_step: object    # jitted (params, batch) -> loss
    flops_per_token: float
    peak_tflops: float | None

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.layout.batch_sharding()

    def device_params(self) -> dict:
        """The parameters in device memory (a copy when they are offloaded to the host)."""
        if not self.offload.params:
            return self.state.params
        return jax.device_put(self.state.params, to_device_kind(self.shardings.params))


def _peak(config) -> float | None:
    return config.metrics.peak_tflops or metrics_lib.peak_tflops(jax.devices()[0].device_kind)


def setup(config, devices=None, init: bool = True) -> Run:
    """Validate, then build mesh, model, data, sharded state and the jitted steps (on all devices
    unless given a subset). With init=False the state is left abstract (ShapeDtypeStructs), to be
    restored from a checkpoint without first allocating a fresh one."""
    devices = list(devices or jax.devices())
    validate(config, len(devices), granule_count(devices))
    layout, notes = layout_from_config(config, devices)
    model, model_notes = model_from_config(config, jax.default_backend())
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    guard, offload = GuardSpec.from_config(config.guard), OffloadSpec.from_config(config.offload)
    check_supported(offload, devices)
    data = make_data(config, layout.batch_sharding())
    if init:
        state, shardings = state_lib.init(model, tx, config.train.seed, layout, guard, offload=offload)
    else:
        state, shardings = state_lib.abstract(model, tx, layout, guard, offload)
    dtype = compute_dtype(config.model.dtype)
    n = metrics_lib.active_params(state.params, model.spec)
    step = jit_train_step(model, tx, schedule, dtype, config.train.grad_accum_steps, layout, shardings,
                          state_lib.grad_shardings(model, layout), guard)
    return Run(config=config, layout=layout, notes=notes + model_notes, model=model, tx=tx, guard=guard,
               offload=offload, data=data,
               state=state, shardings=shardings, train_step=step,
               eval_step=jit_eval_step(model, dtype, layout, shardings.params),
               flops_per_token=metrics_lib.flops_per_token(model.spec, n, config.train.seq_len),
               peak_tflops=_peak(config))


def evaluate(run: Run, batches) -> float:
    """Mean loss over the given validation batches."""
    return float(np.mean([jax.device_get(run.eval_step(run.state.params, b)) for b in batches]))


def _is_log_step(step: int, train_cfg) -> bool:
    return step == 1 or step == train_cfg.steps or step % train_cfg.log_every == 0 or _is_eval_step(step, train_cfg)


def _is_eval_step(step: int, train_cfg) -> bool:
    every = train_cfg.eval_every
    return bool(every) and (step % every == 0 or step == train_cfg.steps)


def compile_step(run: Run):
    """Compile the step ahead of time, so step times never include compilation."""
    t = run.config.train
    batch = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), np.int32, sharding=run.batch_sharding)
    start = time.perf_counter()
    compiled = run.train_step.lower(run.state, {"inputs": batch, "targets": batch}).compile()
    return compiled, time.perf_counter() - start


class _Clock:
    """Wall time per step between log steps, split into waiting for the batch, blocking on
    checkpoint saves, and the rest (the device step); each log step blocks on its metrics."""

    def __init__(self, step: int):
        self.step, self.time = step, time.perf_counter()
        self.data = self.save = 0.0

    def lap(self, step: int) -> dict:
        now = time.perf_counter()
        n = max(step - self.step, 1)
        per_step, data, save = (now - self.time) / n, self.data / n, self.save / n
        self.step, self.time, self.data, self.save = step, now, 0.0, 0.0
        return {"step_time_s": per_step, "data_wait_s": data, "checkpoint_block_s": save,
                "device_step_s": max(per_step - data - save, 0.0)}

    def restart(self) -> None:
        self.time = time.perf_counter()


def _record(run: Run, step: int, metrics: dict, timing: dict, batches_seen: int) -> dict:
    tokens_per_sec = float(metrics["tokens"]) / timing["step_time_s"]
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens": batches_seen * int(metrics["tokens"]),
            "tokens_per_sec": tokens_per_sec, **timing,
            "mfu": metrics_lib.mfu(tokens_per_sec, run.flops_per_token, run.layout.mesh.size, run.peak_tflops),
            "nonfinite_skips": int(metrics["nonfinite_skips"]), "spike_skips": int(metrics["spike_skips"]),
            **{name: float(metrics[name]) for name in run.model.stat_names}}


@dataclasses.dataclass
class Session:
    """A run training on its workdir: what the step loop reads and writes between steps."""

    run: Run
    checkpointer: Checkpointer
    tracker: Tracker
    display: ProgressDisplay
    preemption: PreemptionWatch
    watchdog: Watchdog
    stragglers: StragglerReport
    trace: TraceWindow
    data_step: int = 0   # index of the next training batch (ahead of state.step after a rollback)
    rollbacks: int = 0
    preempted: bool = False
    opened: float = dataclasses.field(default_factory=time.perf_counter)  # when open_session began
    productive_s: float = 0.0   # device step time of every step so far: goodput's numerator
    compile_s: float = 0.0
    _compiled: object = dataclasses.field(default=None, repr=False)
    _val: list | None = dataclasses.field(default=None, repr=False)

    def compiled(self):
        """The train step compiled ahead of time (once per session), so step times never include it."""
        if self._compiled is None:
            self._compiled, self.compile_s = compile_step(self.run)
            self.display.print(f"compiled the train step in {self.compile_s:.1f}s")
        return self._compiled

    def goodput(self, timing: dict, steps: int) -> float:
        """Device step time over wall time since the session opened (setup, restore, compile,
        evaluation, data waits and checkpoint blocking are the rest)."""
        self.productive_s += timing["device_step_s"] * steps
        return self.productive_s / (time.perf_counter() - self.opened)

    def val_batches(self) -> list:
        t = self.run.config.train
        if self._val is None:
            self._val = self.run.data.val_batches(t.eval_batches)
        return self._val

    def position(self) -> dict:
        """What a checkpoint saves beside the state: the data position (independent of devices
        and processes), rollbacks so far, and the tracker runs to continue on resume."""
        return {"global_sample": self.data_step * self.run.config.train.global_batch_size,
                "rollbacks": self.rollbacks, "tracking": self.tracker.ids}

    def report(self, final: bool = False) -> None:
        """Refresh the run report (process 0); at the end of a session also hand it, the config
        and the last checkpoint's path to the tracker runs."""
        if jax.process_index() != 0:
            return
        workdir = self.checkpointer.directory.parent
        files = report_lib.write(workdir) if self.run.config.tracking.report else []
        if final:
            latest = self.checkpointer.latest_step()
            tags = {} if latest is None else {"last_checkpoint": str(self.checkpointer.directory / str(latest))}
            self.tracker.artifacts([workdir / "config.json", *files], tags)

    def save(self, step: int) -> None:
        run = self.run
        meta = {"tokens_seen": self.data_step * run.config.train.global_batch_size * run.config.train.seq_len,
                "mesh": dict(run.layout.mesh.shape), "zero_stage": run.layout.zero_stage,
                "devices": run.layout.mesh.size, "processes": jax.process_count(), "versions": VERSIONS}
        self.checkpointer.save(step, run.state, self.position(), meta, run.config.to_dict())


def _current_step(run: Run) -> int:
    return int(jax.device_get(run.state.step))


def run_steps(session: Session, until: int | None = None) -> list[dict]:
    """Train from the state's step to train.steps (or `until`), saving when due and at the last
    step run; returns the logged records. Stops early, after saving, when preempted."""
    t = session.run.config.train
    last, records = min(t.steps, until or t.steps), []
    session.compiled()
    session.preempted = False
    # Signals are taken over only while steps run: outside them (a notebook between calls)
    # Ctrl-C keeps its usual meaning.
    with session.preemption:
        session.watchdog.start()
        try:
            while (not session.preempted and _current_step(session.run) < last
                   and _steps(session, last, records) == "rollback"):
                pass
        finally:
            session.watchdog.stop()
    session.checkpointer.wait()  # the report names the last committed checkpoint
    session.report(final=True)
    return records


def _steps(session: Session, last: int, records: list[dict]) -> str:
    """Steps until `last`; returns done | preempted | rollback."""
    run, t = session.run, session.run.config.train
    compiled, start = session.compiled(), _current_step(run)
    val = session.val_batches() if t.eval_every else []
    clock, batches = _Clock(start), run.data.train_batches(session.data_step)
    try:
        for step in range(start + 1, last + 1):
            session.trace.before(step)
            began = time.perf_counter()
            batch = next(batches)
            fed = time.perf_counter() - began  # this host's own work: waiting for devices excluded
            clock.data += fed
            run.state, metrics = compiled(run.state, batch)
            session.data_step += 1
            session.watchdog.beat(step)
            session.stragglers.add(step, fed, run.state)
            session.trace.after(step, run.state)
            stop = session.preemption.reached(step)
            if stop or step == last or session.checkpointer.due(step):
                began = time.perf_counter()
                session.save(step)
                clock.save += time.perf_counter() - began
            if run.guard.spike_action == "rollback" and bool(metrics["spike"]) and _rollback(session, step):
                return "rollback"
            if stop or _is_log_step(step, t):
                records.append(_log(session, step, metrics, clock, val))
            if stop:
                session.watchdog.stop()  # the commit wait has its own deadline
                _finish_preemption(session, step)
                session.preempted = True
                return "preempted"
        return "done"
    finally:
        batches.close()
        session.trace.stop(run.state)


def _log(session: Session, step: int, metrics: dict, clock: _Clock, val) -> dict:
    run = session.run
    steps = step - clock.step
    timing = clock.lap(step)
    record = _record(run, step, jax.device_get(metrics), timing, session.data_step)
    record.update(goodput=session.goodput(timing, steps), compile_s=session.compile_s)
    if _is_eval_step(step, run.config.train):
        record["val_loss"] = evaluate(run, val)
        clock.restart()  # evaluation time is not step time
    session.checkpointer.check()  # a background save that failed stops the run here
    session.tracker.write(record)
    session.display.update(record)
    if "val_loss" in record:
        session.report()
    return record


def _rollback(session: Session, step: int) -> bool:
    """Reload the newest checkpoint before a loss spike at `step` and continue with the batches
    after the spike; False (the spike's update stays skipped) when there is none."""
    run, say = session.run, session.display.print
    session.checkpointer.wait()
    restored = session.checkpointer.restore(run.state, step=None, before=step, warn=say)
    if restored is None:
        say(f"warning: loss spike at step {step}; no checkpoint before it to roll back to, its update was skipped")
        return False
    run.state, session.rollbacks = restored.state, session.rollbacks + 1
    session.checkpointer.discard_after(restored.step)  # the abandoned trajectory's saves
    skipped = session.data_step - restored.position["global_sample"] // run.config.train.global_batch_size
    say(f"rollback: loss spike at step {step}; restored step {restored.step} and skip the {skipped} batches "
        f"trained on since it (next batch: {session.data_step})")
    return True


def _finish_preemption(session: Session, step: int) -> None:
    """Wait for the checkpoint of `step` to commit, within the configured time."""
    watch, say = session.preemption, session.display.print
    say(f"{watch.signal_name}: stopping after step {step}; saving it (at most "
        f"{watch.timeout_s:.0f}s after the signal)")
    watch.start_deadline(lambda: _expire(session))
    session.checkpointer.wait()
    say(f"checkpoint of step {step} committed {watch.elapsed():.1f}s after {watch.signal_name}; "
        "run the same command to resume")


def _expire(session: Session) -> None:
    latest = session.checkpointer.latest_step()
    print(f"jaxscale: error: the checkpoint did not commit within checkpoint.preemption_timeout_s="
          f"{session.preemption.timeout_s}; exiting without it (step {latest} is the latest committed)",
          file=sys.stderr, flush=True)
    os._exit(1)


def _summary(run: Run, workdir: Path) -> str:
    params = sum(x.size for x in jax.tree.leaves(run.state.params))
    mesh = " ".join(f"{k}={v}" for k, v in run.layout.mesh.shape.items() if v > 1) or "1 device"
    mesh += f" zero_stage={run.layout.zero_stage}" if run.layout.zero_stage else ""
    return (f"{run.model.spec.family} {params / 1e6:.2f}M params | mesh {mesh} | "
            f"{run.data.num_train_tokens:,} train tokens | {run.flops_per_token / 1e6:.1f} MFLOP/token | "
            f"workdir {workdir}")


@contextlib.contextmanager
def open_session(config, workdir: str | Path, show_progress: bool = True, devices=None) -> Iterator[Session]:
    """Everything a run on `workdir` holds while it trains: the workdir lock, the preemption
    watch, the checkpointer, the run (state restored from where the workdir or the config says),
    the metric writers and the console. Closing it waits for the last checkpoint to commit."""
    workdir, devices, opened = Path(workdir), list(devices or jax.devices()), time.perf_counter()
    _validate(config, devices)  # before touching the workdir
    preemption = PreemptionWatch(config.checkpoint.preemption_timeout_s)  # entered while steps run
    with (contextlib.ExitStack() as stack, WorkdirLock(workdir),
          Checkpointer(workdir / CHECKPOINTS, config.checkpoint) as checkpointer):
        start = resume.choose(config, checkpointer)
        run = setup(config, devices, init=start.kind == "fresh")  # never hold a fresh and a restored state
        with _console(run, workdir, show_progress) as display:
            _introduce(run, workdir, display)
            data_step, tracker_ids = resume.apply(start, run, display.print)
            _describe(run, workdir)
            tracker = stack.enter_context(contextlib.closing(Tracker.open(workdir, config, tracker_ids)))
            d, prof = config.distributed, config.profile
            yield Session(run, checkpointer, tracker, display, preemption, Watchdog(d.watchdog_seconds),
                          StragglerReport(d.straggler_every, d.straggler_threshold, display.print),
                          TraceWindow(prof.start_step, prof.steps, workdir / "profile", display.print), data_step,
                          opened=opened)


def _validate(config, devices) -> None:
    """config.validate, with the job's process and device counts added to its errors."""
    try:
        validate(config, len(devices), granule_count(devices))
    except ConfigError as error:
        if jax.process_count() == 1:
            raise
        raise ConfigError(error.field, error.value, f"{error.fix} (this job: {job_description()})") from None


def _introduce(run: Run, workdir: Path, display: ProgressDisplay) -> None:
    """The summary and notes (process 0), and which batch rows each process reads (every process)."""
    display.print(_summary(run, workdir))
    for note in run.notes:
        display.print(f"note: {note}")
    if xla_flags.applied:
        display.print(f"note: XLA flags for GPUs set (any you put in XLA_FLAGS win): {', '.join(xla_flags.applied)}")
    if jax.process_count() > 1:
        rows = run.data.rows
        print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} devices, "
              f"reads rows {rows.start}:{rows.stop} of each batch", flush=True)


@contextlib.contextmanager
def _console(run: Run, workdir: Path, show_progress: bool):
    """The console of process 0 (the others get a silent one); writes config.json."""
    config, main = run.config, jax.process_index() == 0
    if main:
        (workdir / "config.json").write_text(config_lib.to_json(config))
    display = ProgressDisplay(config.train.steps, 0, main, show_bar=show_progress, show_steps=config.metrics.progress)
    try:
        yield display
    finally:
        display.close()


def _describe(run: Run, workdir: Path) -> None:
    """WORKDIR/sharding.txt: the mesh and every parameter's placement, for the run report."""
    if jax.process_index() == 0:
        (workdir / report_lib.SHARDING).write_text(
            f"{_summary(run, workdir)}\n\n{inspection.sharding_table(run.state.params, 'params/')}\n")


def train(config, workdir: str | Path, show_progress: bool = True, until: int | None = None,
          devices=None) -> list[dict]:
    """Train as the config says (on all devices, or the given ones), writing config.json,
    metrics.jsonl, TensorBoard events and checkpoints; the same call on the same workdir resumes
    from the latest committed checkpoint. `until` stops after that step (call again to go on).
    SIGTERM/SIGINT stop after the step in flight with a checkpoint of it."""
    with open_session(config, workdir, show_progress, devices) as session:
        return run_steps(session, until)
