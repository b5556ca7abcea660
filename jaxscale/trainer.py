"""Training from a notebook or any Python code, on the same code path as `python -m jaxscale.train`.

    from jaxscale import config, Trainer
    cfg = config.load("configs/tiny.py")
    trainer = Trainer(cfg, workdir="runs/nb")      # resumes if runs/nb has a checkpoint
    trainer.add_hook(lambda info: print(info.step, info.record), every=10)   # your own, after each 10th step
    trainer.run(100)                               # call again to go on; Ctrl-C saves and stops
    plt.plot(trainer.metrics["step"], trainer.metrics["loss"])
    print(trainer.generate("The ", max_new_tokens=50))
    trainer.close()                                # or `with Trainer(...) as trainer:`

A Trainer holds its workdir (the lock, the checkpointer, the compiled step) until closed; a second
Trainer or a CLI run on the same workdir is refused meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.analysis import inspection
from jaxscale.runtime import cpu_malloc, loop
from jaxscale.runtime.hooks import StepInfo, UserHook
from jaxscale.runtime.session import open_session


class Trainer:
    def __init__(self, config, workdir: str | Path, devices=None, show_progress: bool = False):
        self.config, self.workdir = config, Path(workdir)
        self._stack = contextlib.ExitStack()
        cpu_malloc.apply_cpu_defaults(config.xla)  # before JAX starts its CPU threads, if it has not yet
        self._session = self._stack.enter_context(open_session(config, self.workdir, show_progress, devices))
        self._records = {r["step"]: r for r in _earlier_records(self.workdir)}
        self._hooks: list[UserHook] = []

    @classmethod
    def from_hf(cls, hf_dir: str | Path, workdir: str | Path | None = None, config=None, **kwargs) -> Trainer:
        """Fine-tune a Hugging Face checkpoint of any family jaxscale imports (docs/models.md):
        checkpoint.init_from=hf_dir (convert.start_from_hf): its weights are converted once into
        WORKDIR/hf_import (parameters only) and the run starts from them with a fresh optimizer;
        a workdir that already has checkpoints resumes them instead. WORKDIR defaults to
        runs/<name of hf_dir>. `config` (default: the defaults; LoRA, preference tuning and the
        rest as it sets them) gets the model's shape, the HF dir's tokenizer.json if it has one,
        and for a GPT-2 a train.seq_len no longer than its positions (lowered with a printed note)."""
        from jaxscale import config as config_lib
        from jaxscale import convert

        workdir = Path("runs") / Path(hf_dir).resolve().name if workdir is None else Path(workdir)
        config = config_lib.defaults() if config is None else config
        config.checkpoint.init_from = str(hf_dir)
        return cls(convert.start_from_hf(config, workdir), workdir, **kwargs)

    # -- training ------------------------------------------------------------------------------

    def add_hook(self, fn: Callable[[StepInfo], object], every: int = 1) -> None:
        """Call fn(StepInfo) after every `every`-th step of the runs to come, after the built-in
        hooks (saving, logging, evaluation): its step, the state, the step's metrics (device
        arrays: reading one waits for the step) and the logged record of a logged step."""
        if every < 1:
            raise ValueError(f"add_hook: every={every}; it must be >= 1 (1 = after every step)")
        self._hooks.append(UserHook(fn, every))

    def run(self, steps: int | None = None) -> list[dict]:
        """Train `steps` more steps (default: up to train.steps, which also sets the schedule's
        length); returns their logged records. Interrupting the kernel saves the step in flight."""
        until = None if steps is None else self.step + steps
        records = loop.run_steps(self._session, until, tuple(self._hooks))
        self._records.update((r["step"], r) for r in records)
        return records

    def evaluate(self) -> float:
        """Mean loss over the held-out batches (train.eval_batches of them)."""
        return loop.evaluate(self._session)

    def save(self) -> int:
        """Checkpoint the current state now and wait for it to commit; returns its step."""
        step = self.step
        self._session.save(step)
        self._session.services.checkpointer.wait()
        return step

    # -- looking at the run --------------------------------------------------------------------

    def plan(self, search: bool = False, topology: str | None = None, tokens: float | None = None,
             compile: int = 8, budget_s: float = 1200.0):
        """This run's compiled plan (the dict `python -m jaxscale.plan --json` prints); with
        search=True the layouts ranked for `topology` (default: this run's devices) as
        `python -m jaxscale.plan --search` ranks them: a pandas DataFrame when pandas is installed,
        else a list of dicts, and the picture of the ranking in WORKDIR/search.png."""
        from jaxscale import plan as plan_lib
        from jaxscale.analysis import search as search_lib

        devices = self._session.run.devices
        if not search:
            return plan_lib.make_plan(self.config, devices=devices)
        target = plan_lib.search_target(topology, devices=None if topology else devices)
        rows = search_lib.search(self.config, target, count=compile, budget_s=budget_s, workers=1).rows
        search_lib.draw(rows, target, self.workdir / "search.png")
        table = search_lib.records(rows, target, tokens)
        try:
            import pandas
        except ImportError:
            return table
        return pandas.DataFrame(table)

    @property
    def step(self) -> int:
        return self._session.live.step

    @property
    def state(self):
        """The TrainState (params, opt_state, step, rng, guard), sharded on the run's mesh."""
        return self._session.live.state

    @property
    def mesh(self):
        return self._session.run.layout.mesh

    @property
    def metrics(self) -> dict[str, list]:
        """Every logged step of this workdir so far, as columns ready to plot: {'step': [...],
        'loss': [...], 'val_loss': [...], ...}; NaN where a step lacks a value (val_loss)."""
        records = [self._records[s] for s in sorted(self._records)]
        keys = dict.fromkeys(k for r in records for k in r)
        return {k: [r.get(k, math.nan) for r in records] for k in keys}

    def sharding_table(self) -> str:
        """Shape, PartitionSpec and MiB per device of every parameter and optimizer array."""
        state = self.state
        return "\n\n".join([inspection.sharding_table(state.weights, "params/"),
                            inspection.sharding_table(state.opt_state, "opt_state/")])

    def show_sharding(self, array) -> None:
        """Draw which device holds which block of a 1-D or 2-D array (e.g. trainer.state.params['embed'])."""
        inspection.show_sharding(array)

    # -- using the model -----------------------------------------------------------------------

    def logits(self, tokens) -> np.ndarray:
        """float32 logits [B, L, V] of token ids [B, L] (or [L]) under the current parameters."""
        run = self._session.run
        tokens = jnp.asarray(tokens, jnp.int32)
        tokens = tokens[None] if tokens.ndim == 1 else tokens
        model, dtype = run.model.unsharded(), run.step_spec.dtype  # any batch size, outside the training layout
        apply = jax.jit(lambda p, t: model.apply(jax.tree.map(lambda x: x.astype(dtype), p), t))
        return np.asarray(apply(self._device_params(), tokens))

    def generate(self, prompt: str | list[int], max_new_tokens: int = 100, temperature: float = 0.0,
                 top_k: int = 0, seed: int = 0) -> str:
        """The continuation of `prompt` (text, or token ids) under the current parameters: greedy
        at temperature 0, else sampled (from the top_k most likely tokens when top_k > 0)."""
        from jaxscale import sampling

        session = self._session
        tokenizer = session.data.tokenizer
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        new = sampling.generate(session.run.model, self._device_params(), ids, max_new_tokens,
                                temperature=temperature, top_k=top_k, seed=seed, dtype=session.run.step_spec.dtype)
        return tokenizer.decode(new)

    def _device_params(self) -> dict:
        return self._session.run.device_params(self._session.live.state.weights)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the last checkpoint to commit and release the workdir."""
        self._stack.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _earlier_records(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if jax.process_index() != 0 or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
