"""jaxscale's train step and loop against a hand-written bare-JAX step of the same math.

    python benchmarks/overhead.py [--config=configs/tiny.py] [--rounds=7] [--steps=20] [--checkpoint_every=50]
        [--override=a.b=v ...] [--json] [--append] [--smoke]

jaxscale's whole loop runs as in training: the Grain pipeline, metrics fetched and written every
step, an asynchronous checkpoint every `--checkpoint_every` steps. Both run on the same mesh and
batch size, interleaved round by round so machine noise hits both; the table reports medians and
the jaxscale/bare ratios (lower is better, 1.0 = no cost), and the loop's mean, which includes
the steps that saved.
The bare step is written with jax.numpy only (no Flax, no jaxscale) for llama-family configs.
Time to first step is measured once each, in the same process, from an initialised state:
jaxscale's loop compiling its step, starting the data pipeline and running step 1, against the
bare step's first call (trace, compile, run). `--json` prints step_time_ratio and
compile_time_ratio (jaxscale / bare) with the times behind them.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import contextlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from jaxscale import config as config_lib
from jaxscale.build import Run
from jaxscale.models.precision import compute_dtype
from jaxscale.optim import make_optimizer
from jaxscale.runtime import loop
from jaxscale.runtime.session import Session, open_session

SMOKE_OVERRIDES = ["model.d_model=64", "model.d_ff=128", "train.seq_len=32", "train.global_batch_size=8"]


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def _rope(x, theta):
    half, length = x.shape[-1] // 2, x.shape[1]
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * theta ** (-jnp.arange(half) / half)
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _attention(h, p, spec):
    q = _rope(jnp.einsum("bld,dhe->blhe", h, p["wq"]), spec.rope_theta)
    k = _rope(jnp.einsum("bld,dke->blke", h, p["wk"]), spec.rope_theta)
    v = jnp.einsum("bld,dke->blke", h, p["wv"])
    group = spec.num_heads // spec.num_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("blhe,bmhe->bhlm", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((h.shape[1], h.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), -1).astype(v.dtype)
    return jnp.einsum("blhe,hed->bld", jnp.einsum("bhlm,bmhe->blhe", probs, v), p["wo"])


def bare_loss(params, batch, spec, dtype):
    """Llama forward + cross entropy in plain jax.numpy over jaxscale's parameter dict."""
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    x = params["embed"][batch["inputs"]]

    def layer(x, p):
        x = x + _attention(_rms(x, p["attn_norm"]["scale"], spec.norm_eps), p["attn"], spec)
        h = _rms(x, p["mlp_norm"]["scale"], spec.norm_eps)
        m = p["mlp"]
        return x + (jax.nn.silu(h @ m["w_gate"]) * (h @ m["w_up"])) @ m["w_down"], None

    x = _rms(jax.lax.scan(layer, x, params["layers"])[0], params["final_norm"]["scale"], spec.norm_eps)
    logits = jnp.einsum("bld,vd->blv", x, params["embed"], preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def bare_step(run: Run, tx, dtype):
    """jit(value_and_grad + optax update) with the same shardings and donation as jaxscale's."""
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(bare_loss)(params, batch, run.model.spec, dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    s = run.shardings
    return jax.jit(step, in_shardings=(s.params, s.opt_state, run.batch_sharding), donate_argnums=(0, 1))


def _time_bare(step, params, opt_state, batch, n):
    start = time.perf_counter()
    for _ in range(n):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    return params, opt_state, (time.perf_counter() - start) / n


def _loop_steps(session: Session, n: int) -> list[dict]:
    """n steps of jaxscale's own loop (data, metrics, logging every step); their records."""
    return loop.run_steps(session, until=session.live.step + n)


def _time_loop(session: Session, n: int) -> tuple[float, float]:
    """(median, mean) step time of jaxscale's loop over n steps, the first (which waits for data) left out."""
    times = [r["step_time_s"] for r in _loop_steps(session, n)[1:]]
    return statistics.median(times), statistics.fmean(times)


def _time_first_loop_step(session: Session) -> float:
    """Seconds for the loop's first step: compiling the step, starting the data pipeline, step 1."""
    start = time.perf_counter()
    _loop_steps(session, 1)
    return time.perf_counter() - start


def measure(config, rounds: int, steps: int, checkpoint_every: int) -> dict:
    config.train.update(log_every=1, eval_every=0, steps=1 + rounds * steps)
    config.checkpoint.update(every_steps=checkpoint_every, max_to_keep=2)  # async saves inside the timed loop
    with tempfile.TemporaryDirectory() as workdir, open_session(config, workdir, show_progress=False) as session:
        return _measure(session, rounds, steps)


def _measure(session: Session, rounds: int, steps: int) -> dict:
    run, config = session.run, session.run.config
    tx, _ = make_optimizer(config.optim, config.train.steps)
    dtype = compute_dtype(config.model.dtype, jax.default_backend())
    bare = bare_step(run, tx, dtype)
    batch = next(session.data.train_batches(0))
    params = jax.tree.map(jnp.copy, session.live.state.params)
    opt_state = jax.tree.map(jnp.copy, session.live.state.opt_state)
    state = session.live.state
    ref_loss = float(run.eval_step(state.params, state.base, batch)["loss"])
    check = float(jax.jit(bare_loss, static_argnums=(2, 3))(params, batch, run.model.spec, dtype))
    loop_first = _time_first_loop_step(session)
    params, opt_state, bare_first = _time_bare(bare, params, opt_state, batch, 1)  # compiles
    loop_times, bare_times = [], []
    for _ in range(rounds):
        loop_times.append(_time_loop(session, steps))
        params, opt_state, t = _time_bare(bare, params, opt_state, batch, steps)
        bare_times.append(t)
    loop_s, bare_s = statistics.median(m for m, _ in loop_times), statistics.median(bare_times)
    return {"loop_s": loop_s, "loop_mean_s": statistics.median(m for _, m in loop_times), "bare_s": bare_s,
            "step_time_ratio": loop_s / bare_s,
            "loop_first_step_s": loop_first, "bare_first_step_s": bare_first,
            "compile_time_ratio": loop_first / bare_first, "loss_gap": abs(ref_loss - check) / ref_loss,
            "tokens": config.train.global_batch_size * config.train.seq_len, "devices": jax.device_count(),
            "rounds": rounds, "steps": steps, "checkpoint_every": config.checkpoint.every_steps}


def report(config_path: str, result: dict) -> str:
    """The markdown entry: median step times, their ratio, and the time to first step."""
    return _common.entry(f"overhead: `{config_path}` on {jax.device_count()} devices", "\n".join([
        "| step | median step time | tokens/s |",
        "|---|---|---|",
        f"| jaxscale loop (data, metrics, checkpoint every {result['checkpoint_every']}) "
        f"| {result['loop_s'] * 1e3:.1f} ms (mean {result['loop_mean_s'] * 1e3:.1f} ms) "
        f"| {result['tokens'] / result['loop_s']:,.0f} |",
        f"| bare JAX step, resident batch | {result['bare_s'] * 1e3:.1f} ms "
        f"| {result['tokens'] / result['bare_s']:,.0f} |",
        "",
        f"ratio jaxscale/bare: **{result['step_time_ratio']:.3f}**; same math check: relative loss gap "
        f"{result['loss_gap']:.1e}.",
        f"Time to first step, compilation included: jaxscale loop {result['loop_first_step_s']:.2f} s, "
        f"bare {result['bare_first_step_s']:.2f} s, ratio **{result['compile_time_ratio']:.2f}**.",
    ]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint_every", type=int, default=50, help="async checkpoint every N steps of the loop")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 2
        args.override = SMOKE_OVERRIDES + args.override
    config = config_lib.load(args.config)
    config_lib.apply_overrides(config, args.override + ["metrics.progress=False", "tracking.writers=jsonl"])
    with contextlib.redirect_stdout(sys.stderr):  # the run's own messages; stdout is the report
        result = measure(config, args.rounds, args.steps, args.checkpoint_every)
    _common.report(args, report(args.config, result),
                   {"benchmark": "overhead", "config": args.config, "overrides": args.override, **result})


if __name__ == "__main__":
    main()
