"""The training loop: build everything from a validated config, then step, log and evaluate."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxscale import config as config_lib
from jaxscale import metrics as metrics_lib
from jaxscale import state as state_lib
from jaxscale.checkpoint import Checkpointer
from jaxscale.data import Data, make_data
from jaxscale.mesh import granule_count
from jaxscale.models import LanguageModel, model_from_config
from jaxscale.optim import make_optimizer
from jaxscale.progress import ProgressDisplay
from jaxscale.sharding import Layout, layout_from_config
from jaxscale.step import compute_dtype, jit_eval_step, jit_train_step


@dataclasses.dataclass
class Run:
    """Everything built from the config before the first step."""

    config: object
    layout: Layout
    model: LanguageModel
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


def _peak(config) -> float | None:
    return config.metrics.peak_tflops or metrics_lib.peak_tflops(jax.devices()[0].device_kind)


def setup(config, devices=None, init: bool = True) -> Run:
    """Validate, then build mesh, model, data, sharded state and the jitted steps (on all devices
    unless given a subset). With init=False the state is left abstract (ShapeDtypeStructs), to be
    restored from a checkpoint without first allocating a fresh one."""
    devices = list(devices or jax.devices())
    config_lib.validate(config, len(devices), granule_count(devices))
    layout, notes = layout_from_config(config, devices)
    model, model_notes = model_from_config(config, jax.default_backend())
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    data = make_data(config, layout.batch_sharding())
    if init:
        state, shardings = state_lib.init(model, tx, config.train.seed, layout)
    else:
        state, shardings = state_lib.abstract(model, tx, layout), state_lib.shardings(model, tx, layout)
    dtype = compute_dtype(config.model.dtype)
    n = metrics_lib.non_embedding_params(state.params)
    step = jit_train_step(model, tx, schedule, dtype, config.train.grad_accum_steps, layout, shardings,
                          state_lib.grad_shardings(model, layout))
    return Run(config=config, layout=layout, notes=notes + model_notes, model=model, data=data, state=state,
               shardings=shardings, train_step=step,
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


class _Timer:
    """Wall time and tokens between log steps; each log step blocks on its metrics."""

    def __init__(self, step: int):
        self.step, self.time = step, time.perf_counter()

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.time) / max(step - self.step, 1)
        self.step, self.time = step, now
        return per_step

    def restart(self) -> None:
        self.time = time.perf_counter()


def _record(run: Run, step: int, metrics: dict, step_time: float) -> dict:
    tokens_per_sec = float(metrics["tokens"]) / step_time
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens": step * int(metrics["tokens"]),
            "tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
            "mfu": metrics_lib.mfu(tokens_per_sec, run.flops_per_token, run.layout.mesh.size, run.peak_tflops)}


def run_steps(run: Run, display: ProgressDisplay, writer: metrics_lib.MetricsWriter,
              checkpointer: Checkpointer | None = None, until: int | None = None, data_step: int | None = None) -> list[dict]:
    """Train from run.state.step to train.steps (or `until`); returns the logged records.

    Saves a checkpoint when one is due and at the last step run. `data_step` is the step whose
    batch comes next (default: the state's step).
    """
    t = run.config.train
    compiled, compile_s = compile_step(run)
    display.print(f"compiled the train step in {compile_s:.1f}s")
    val = run.data.val_batches(t.eval_batches) if t.eval_every else []
    start = int(jax.device_get(run.state.step))
    last = min(t.steps, until or t.steps)
    timer, records = _Timer(start), []
    batches = run.data.train_batches(start if data_step is None else data_step)
    for step, batch in zip(range(start + 1, last + 1), batches):
        run.state, metrics = compiled(run.state, batch)
        if checkpointer is not None:
            checkpointer.save(step, run.state, {"global_sample": step * t.global_batch_size}, final=step == last)
        if not _is_log_step(step, t):
            continue
        record = _record(run, step, jax.device_get(metrics), timer.lap(step))
        if _is_eval_step(step, t):
            record["val_loss"] = evaluate(run, val)
            timer.restart()  # evaluation time is not step time
        writer.write(record)
        display.update(record)
        records.append(record)
    return records


def resume(run: Run, checkpointer: Checkpointer, display: ProgressDisplay) -> int | None:
    """Load the latest committed checkpoint into run.state; returns the data step to continue from."""
    restored = checkpointer.restore(run.shardings, run.state)
    if restored is None:
        return None
    run.state, position = restored
    step = int(jax.device_get(run.state.step))
    display.print(f"resuming from step {step} (checkpoint {checkpointer.latest_step()}, "
                  f"global sample {position['global_sample']:,})")
    return position["global_sample"] // run.config.train.global_batch_size


def _summary(run: Run, workdir: Path) -> str:
    params = sum(x.size for x in jax.tree.leaves(run.state.params))
    mesh = " ".join(f"{k}={v}" for k, v in run.layout.mesh.shape.items() if v > 1) or "1 device"
    mesh += f" zero_stage={run.layout.zero_stage}" if run.layout.zero_stage else ""
    return (f"{run.model.spec.family} {params / 1e6:.2f}M params | mesh {mesh} | "
            f"{run.data.num_train_tokens:,} train tokens | {run.flops_per_token / 1e6:.1f} MFLOP/token | "
            f"workdir {workdir}")


def train(config, workdir: str | Path, show_progress: bool = True, until: int | None = None) -> list[dict]:
    """Train as the config says, writing config.json, metrics.jsonl, TensorBoard events and
    checkpoints; the same call on the same workdir resumes from the latest committed checkpoint.
    `until` stops after that step (the run can be continued by calling again)."""
    workdir = Path(workdir)
    config_lib.validate(config, jax.device_count(), granule_count(jax.devices()))  # before touching the workdir
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    try:
        run = setup(config, init=checkpointer.latest_step() is None)  # never hold a fresh and a restored state
        return _train(run, workdir, checkpointer, show_progress, until)
    finally:
        checkpointer.close()


def _train(run: Run, workdir: Path, checkpointer: Checkpointer, show_progress: bool, until: int | None) -> list[dict]:
    config = run.config
    main = jax.process_index() == 0
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config_lib.to_json(config))
    display = ProgressDisplay(config.train.steps, 0, main and config.metrics.progress, show_bar=show_progress)
    writer = metrics_lib.MetricsWriter(workdir, main, config.metrics.tensorboard)
    try:
        display.print(_summary(run, workdir))
        for note in run.notes:
            display.print(f"note: {note}")
        data_step = resume(run, checkpointer, display)
        return run_steps(run, display, writer, checkpointer, until, data_step)
    finally:
        writer.close()
        display.close()
