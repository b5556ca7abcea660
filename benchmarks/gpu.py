"""Tokens/s and MFU of the GPU configs, swept over batch size, remat policy and XLA flag sets.

    python benchmarks/gpu.py [--configs=configs/gpt2_124m.py,configs/llama_1b.py] [--batch_sizes=8,16,32]
        [--remat=none,dots_saveable,full] [--flag_sets=jaxscale,none] [--seq_len=2048] [--steps=10]
        [--override=a.b=v ...] [--profile] [--json] [--append] [--smoke]

Every combination runs in a fresh process (XLA reads its flags once, when the backend starts):
bfloat16 compute, the attention kernel `auto` picks (cuDNN flash attention on NVIDIA GPUs),
synthetic tokens, the compiled train step timed over `--steps` steps after two warm-up steps
(median), MFU by the PaLM convention against the device's dense bf16 peak (jaxscale/analysis/mfu.py),
and the device memory the step holds (its inputs and temporaries, from XLA's memory analysis).
`--flag_sets`: `jaxscale` = jaxscale's GPU defaults (jaxscale/runtime/xla_flags.py), `none` = XLA's own
defaults. A combination that does not fit in memory is reported as such, not fatal. `--profile`
also traces 3 steps of each (jax.profiler) and adds where the GPU's kernel time goes, by class
(benchmarks/_kernels.py: GEMMs by dtype, cuDNN attention forward and backward, copies, the
optimizer, reductions, other fusions), so that one call on a GPU gives the whole account.
`--smoke` runs configs/tiny.py on CPU, one combination, to keep the script working.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _kernels
import _steps

SMOKE = {"configs": "configs/tiny.py", "batch_sizes": "8", "remat": "dots_saveable", "flag_sets": "jaxscale",
         "seq_len": 64, "steps": 2}


def _worker(args) -> dict:
    """One combination, in this process: compile the step and time it."""
    import jax

    from jaxscale import config as config_lib
    from jaxscale.analysis import mfu

    config = config_lib.load(args.config)
    config_lib.apply_overrides(config, [
        f"train.global_batch_size={args.batch}", f"train.seq_len={args.seq_len}", f"model.remat={args.remat}",
        "model.dtype=bfloat16", "data.source=synthetic", "train.eval_every=0", *args.override])
    config.model.max_seq_len = max(config.model.max_seq_len, args.seq_len)
    run, compiled, compile_s, state, batches = _steps.prepare(config)
    times = []
    for i in range(args.steps + 2):
        began = time.perf_counter()
        state, out = compiled(state, next(batches))
        jax.block_until_ready(out["loss"])
        if i >= 2:
            times.append(time.perf_counter() - began)
    step_s = statistics.median(times)
    kernels = _profile(compiled, state, batches) if args.profile else None
    tokens_per_sec = args.batch * args.seq_len / step_s
    memory = compiled.memory_analysis()
    return {"step_s": step_s, "tokens_per_sec": tokens_per_sec, "compile_s": compile_s,
            "mfu": mfu.mfu(tokens_per_sec, run.flops_per_token, run.layout.mesh.size, run.peak_tflops),
            "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "attention": run.model.spec.attention_impl,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None), "loss": float(out["loss"]),
            # what the step holds on the device: its inputs (state, batch; the outputs reuse them) and temporaries
            "memory_bytes": memory.argument_size_in_bytes + memory.temp_size_in_bytes,
            **({"kernels_ms": kernels} if kernels is not None else {})}


def _profile(compiled, state, batches, steps: int = 3) -> dict[str, float]:
    """Milliseconds a step by kernel class (benchmarks/_kernels.py) over a trace of `steps` steps."""
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, out = compiled(state, next(batches))
            jax.block_until_ready(out["loss"])
        times = _kernels.kernel_times(trace_dir, compiled.as_text())
    return {name: ns / steps / 1e6 for name, ns in times.items()}


def _combination_env(flag_set: str) -> dict:
    """The worker's environment: the flag set is chosen here, before its JAX starts."""
    from jaxscale.runtime import xla_flags

    env = dict(os.environ)
    if flag_set == "jaxscale":
        env["XLA_FLAGS"] = xla_flags.with_defaults(env.get("XLA_FLAGS", ""))
    return env


def _run_one(config: str, batch: int, remat: str, flag_set: str, args) -> dict:
    row = {"config": config, "batch": batch, "remat": remat, "flag_set": flag_set, "seq_len": args.seq_len}
    cmd = [sys.executable, __file__, "--worker", f"--config={config}", f"--batch={batch}", f"--remat={remat}",
           f"--seq_len={args.seq_len}", f"--steps={args.steps}", *(f"--override={o}" for o in args.override),
           *(["--profile"] if args.profile else [])]
    done = subprocess.run(cmd, env=_combination_env(flag_set), capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return {**row, **json.loads(lines[-1])}
    memory = any(word in done.stderr for word in ("RESOURCE_EXHAUSTED", "Out of memory", "OOM"))
    return {**row, "error": "out of memory" if memory else (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}


def report(rows: list[dict], overrides: list[str] = ()) -> str:
    """The results entry; each set of --override values is an entry of its own."""
    def cell(r):
        if "error" in r:
            return f"| {r['config']} | {r['batch']} | {r['remat']} | {r['flag_set']} | {r['error']} | | | |"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        return (f"| {r['config']} | {r['batch']} | {r['remat']} | {r['flag_set']} | {r['step_s'] * 1e3:,.1f} ms "
                f"| {r['tokens_per_sec']:,.0f} | {mfu} | {r['memory_bytes'] / 2**30:.2f} GiB |")
    ok = [r for r in rows if "error" not in r]
    where = f"{ok[0]['devices']} x {ok[0]['device']}, attention {ok[0]['attention']}" if ok else "no run succeeded"
    kernels = [f"\n{r['config']}, batch {r['batch']}, remat {r['remat']}, {r['flag_set']} flags:\n\n"
               + _kernels.table(r["kernels_ms"]) for r in ok if "kernels_ms" in r]
    configs = ", ".join(dict.fromkeys(Path(r["config"]).stem for r in rows))
    variant = "".join(f", {o}" for o in overrides)
    return _common.entry(f"gpu: {configs}, seq {rows[0]['seq_len']}, bf16{variant}, {where}", "\n".join(
        ["| config | global batch | remat | XLA flags | step | tokens/s | MFU | memory |", "|---" * 8 + "|"]
        + [cell(r) for r in rows] + kernels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/gpt2_124m.py,configs/llama_1b.py")
    parser.add_argument("--batch_sizes", default="8,16,32")
    parser.add_argument("--remat", default="none,dots_saveable,full")
    parser.add_argument("--flag_sets", default="jaxscale,none")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    parser.add_argument("--profile", action="store_true", help="add kernel time by class from a trace of 3 steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)), flush=True)
        return
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    grid = itertools.product(args.configs.split(","), map(int, args.batch_sizes.split(",")), args.remat.split(","),
                             args.flag_sets.split(","))
    rows = [_run_one(*combination, args) for combination in grid]
    _common.report(args, report(rows, args.override), {"benchmark": "gpu", "rows": rows})


if __name__ == "__main__":
    main()
