"""A run held on its workdir: the frozen Run, the one owner of what changes (RunState), and the
services a training loop talks to (checkpointer, tracker, console, preemption, health, tracing).

    with open_session(config, workdir) as session:     # lock, restore or init, writers, console
        loop.run_steps(session)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import jax

from jaxscale import config as config_lib
from jaxscale import convert
from jaxscale import report as report_lib
from jaxscale import state as state_lib
from jaxscale.analysis import inspection
from jaxscale.build import Run, build
from jaxscale.checkpoint import CHECKPOINTS, Checkpointer, LocalCheckpointer
from jaxscale.data import Data, make_data
from jaxscale.errors import ConfigError
from jaxscale.runtime import cpu_malloc, jax_cache, preflight, program_cache, resume, xla_flags
from jaxscale.runtime.distributed import job_description
from jaxscale.runtime.health import StragglerReport, Watchdog
from jaxscale.runtime.preemption import PreemptionWatch
from jaxscale.runtime.profiler import TraceWindow
from jaxscale.runtime.progress import ProgressDisplay
from jaxscale.runtime.runstate import RunState
from jaxscale.runtime.workdir import WorkdirLock
from jaxscale.tracking import Tracker
from jaxscale.version import __version__

VERSIONS = {"jaxscale": __version__, "jax": jax.__version__, "orbax": version("orbax-checkpoint")}


@dataclasses.dataclass(frozen=True)
class Services:
    """What the loop reports to and is stopped by."""

    checkpointer: Checkpointer
    local: LocalCheckpointer | None  # checkpoint.local_every_steps: copies in host memory between persistent saves
    tracker: Tracker
    display: ProgressDisplay
    preemption: PreemptionWatch
    watchdog: Watchdog
    stragglers: StragglerReport
    trace: TraceWindow


@dataclasses.dataclass
class Session:
    """A run training on its workdir."""

    run: Run
    data: Data
    live: RunState               # state, data position, counters: all that changes
    services: Services
    opened: float = dataclasses.field(default_factory=time.perf_counter)  # when open_session began
    compile_s: float = 0.0
    _compiled: object = dataclasses.field(default=None, repr=False)
    _val: list | None = dataclasses.field(default=None, repr=False)
    _reported: float = dataclasses.field(default_factory=time.perf_counter, repr=False)  # the last report

    def compiled(self):
        """The train step compiled ahead of time (once per session), so step times never include it."""
        if self._compiled is None:
            lowered_hits, whole_hits = jax_cache.hits(), program_cache.hits()
            self._compiled, self.compile_s = self.run.compile(self.data.keys)
            how = "compiled the train step"
            if program_cache.hits() > whole_hits:
                how = "loaded the whole train step from the cache"
            elif jax_cache.hits() > lowered_hits:
                how = "loaded the compiled train step from the cache"
            self.services.display.print(f"{how} in {self.compile_s:.1f}s")
            if note := cpu_malloc.fit_scratch(self._compiled):
                self.services.display.print(f"note: {note}")
        return self._compiled

    def val_batches(self) -> list:
        if self._val is None:
            self._val = self.data.val_batches(self.run.config.train.eval_batches)
        return self._val

    def position(self) -> dict:
        """What a checkpoint saves beside the state: the data position (independent of devices
        and processes) and what the data was, rollbacks so far, and the tracker runs to continue on resume."""
        return {"global_sample": self.live.data_step * self.run.config.train.global_batch_size,
                "rollbacks": self.live.rollbacks, "tracking": self.services.tracker.ids, "data": self.data.identity()}

    def save(self, step: int) -> None:
        run, t = self.run, self.run.config.train
        meta = {"tokens_seen": self.live.data_step * t.global_batch_size * t.seq_len,
                "mesh": dict(run.layout.mesh.shape), "zero_stage": run.layout.zero_stage,
                "devices": run.layout.mesh.size, "processes": jax.process_count(), "versions": VERSIONS}
        self.services.checkpointer.save(step, state_lib.changing(self.live.state), self.position(), meta,
                                        run.config.to_dict())

    def report(self, final: bool = False) -> None:
        """Refresh the run report (process 0) if tracking.report_every_minutes have passed since the
        last refresh (or the session's start); at the end of a session always, and also hand it,
        the config and the last checkpoint's path to the tracker runs."""
        if jax.process_index() != 0:
            return
        tracking, now = self.run.config.tracking, time.perf_counter()
        if not final and now - self._reported < tracking.report_every_minutes * 60:
            return  # drawing takes about a second: not at every evaluation of a short run
        self._reported = now
        checkpointer = self.services.checkpointer
        workdir = checkpointer.directory.parent
        files = report_lib.write(workdir) if tracking.report else []
        if final:
            latest = checkpointer.latest_step()
            tags = {} if latest is None else {"last_checkpoint": str(checkpointer.directory / str(latest))}
            self.services.tracker.artifacts([workdir / "config.json", *files], tags)


@contextlib.contextmanager
def open_session(config, workdir: str | Path, show_progress: bool = True, devices=None) -> Iterator[Session]:
    """Everything a run on `workdir` holds while it trains: the workdir lock, the checkpointer,
    the run and its state (restored from where the workdir or the config says, else fresh), the
    metric writers and the console. Closing it waits for the last checkpoint to commit."""
    workdir, devices, opened = Path(workdir), list(devices or jax.devices()), time.perf_counter()
    config = convert.start_from_hf(config, workdir, _print_once)  # init_from a Hugging Face directory
    cache_note = jax_cache.enable(config.xla)
    run = _build(config, devices)  # validated, and the data found, before the workdir is touched
    if config.distributed.preflight and jax.process_count() > 1:
        preflight.check(run.layout.mesh, workdir / CHECKPOINTS, _print_once)
    data = make_data(config, run.batch_sharding)
    with (contextlib.ExitStack() as stack, WorkdirLock(workdir),
          Checkpointer(workdir / CHECKPOINTS, config.checkpoint) as checkpointer):
        start = resume.choose(config, checkpointer)
        local = LocalCheckpointer(workdir, config.checkpoint, run.layout.mesh) if config.checkpoint.local_every_steps \
            else None
        with _console(run, workdir, show_progress) as display:
            _introduce(run, data, workdir, display, cache_note)
            live, tracker_ids = resume.apply(start, run, display.print, data.identity(), local)
            _describe(run, data, live, workdir)
            tracker = stack.enter_context(contextlib.closing(Tracker.open(workdir, config, tracker_ids)))
            yield Session(run, data, live, _services(config, workdir, checkpointer, local, tracker, display), opened)
        if local is not None:  # a run that ends well leaves no copy the persistent checkpoints supersede
            checkpointer.wait()
            latest = checkpointer.latest_step()
            local.discard(keep=lambda step: latest is None or step > latest)


def _print_once(line: str) -> None:
    """Print on process 0 only (before the console exists)."""
    if jax.process_index() == 0:
        print(line, flush=True)


def _services(config, workdir: Path, checkpointer: Checkpointer, local: LocalCheckpointer | None, tracker: Tracker,
              display) -> Services:
    d, prof = config.distributed, config.profile
    return Services(checkpointer, local, tracker, display, PreemptionWatch(config.checkpoint.preemption_timeout_s),
                    Watchdog(d.watchdog_seconds),
                    StragglerReport(d.straggler_every, d.straggler_threshold, display.print),
                    TraceWindow(prof.start_step, prof.steps, workdir / "profile", display.print))


def _build(config, devices) -> Run:
    """build(), with the job's process and device counts added to its config errors."""
    try:
        return build(config, devices)
    except ConfigError as error:
        if jax.process_count() == 1:
            raise
        raise ConfigError(error.field, error.value, f"{error.fix} (this job: {job_description()})") from None


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


def _introduce(run: Run, data: Data, workdir: Path, display: ProgressDisplay, cache_note: str | None) -> None:
    """The summary and notes (process 0), and which batch rows each process reads (every process)."""
    display.print(summary(run, data, workdir))
    for note in run.notes + ((cache_note,) if cache_note else ()):
        display.print(f"note: {note}")
    for note in data.notes:
        display.print(note)
    if xla_flags.applied:
        display.print(f"note: XLA flags for GPUs set (any you put in XLA_FLAGS win): {', '.join(xla_flags.applied)}")
    if cpu_malloc.applied:
        display.print(f"note: malloc keeps XLA:CPU's step buffers in the heap (any MALLOC_* you set wins): "
                      f"{', '.join(cpu_malloc.applied)}")
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} devices, "
              f"reads rows {data.rows.start}:{data.rows.stop} of each batch", flush=True)


def summary(run: Run, data: Data, workdir: Path) -> str:
    """One line: model size, mesh, parallel strategy, tokens, FLOPs per token and the workdir."""
    params = sum(x.size for x in jax.tree.leaves(run.abstract_state.weights))
    mesh = " ".join(f"{k}={v}" for k, v in run.layout.mesh.shape.items() if v > 1) or "1 device"
    mesh += f" zero_stage={run.layout.zero_stage}" if run.layout.zero_stage else ""
    strategy = run.model.spec.strategy.describe()
    return (f"{run.model.spec.family} {params / 1e6:.2f}M params | mesh {mesh}"
            + ("" if strategy == "none" else f" | {strategy}")
            + f" | {data.num_train_tokens:,} train tokens | {run.flops_per_token / 1e6:.1f} MFLOP/token"
            + f" | workdir {workdir}")


def _describe(run: Run, data: Data, live: RunState, workdir: Path) -> None:
    """WORKDIR/sharding.txt: the mesh and every parameter's placement, for the run report."""
    if jax.process_index() == 0:
        (workdir / report_lib.SHARDING).write_text(
            f"{summary(run, data, workdir)}\n\n{inspection.sharding_table(live.state.weights, 'params/')}\n")
