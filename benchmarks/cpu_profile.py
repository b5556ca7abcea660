"""Where XLA:CPU spends a train step: a jax.profiler trace of compiled steps, each thunk's time
summed by what it does.

    python benchmarks/cpu_profile.py [--shape=tiny|gpt2] [--steps=10] [--top=12] [--override=a.b=v ...]
        [--json] [--append] [--smoke]

One fake CPU device; shapes as benchmarks/torch_reference.py. XLA:CPU is asked to mark each thunk
in the trace (--xla_cpu_enable_xprof_traceme); the thunks' durations are summed per step by kind:
matmuls (XNNPACK/YNNPACK fusions and dots), copies and transposes, broadcasts, slices into and
out of stacked arrays (a scanned loop's residuals), and the other fusions (elementwise, reductions).
Thunks run on two threads at once here, so the kinds can add up past the step's wall time. The
largest single thunks are listed with the HLO operation they come from.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import os

_common.fake_cpu_devices(1)
os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from torch_reference import SHAPES, SMOKE  # noqa: E402

KINDS = (("matmul", ("ynn_fusion", "xnn_fusion", "dot")), ("copy/transpose", ("copy", "transpose")),
         ("broadcast", ("broadcast",)), ("stacked slices", ("dynamic-slice", "dynamic-update-slice")))
CONTAINERS = ("while", "cond", "call", "ThunkExecutor", "SlinkyThreadPool")


def kind_of(name: str) -> str:
    for kind, marks in KINDS:
        if any(mark in name for mark in marks):
            return kind
    return "other fusions"


def thunk_times(trace_dir: Path) -> collections.Counter:
    """Nanoseconds per XLA:CPU thunk name over the whole trace (every thread)."""
    from jax._src.lib import _profile_data

    times = collections.Counter()
    for path in trace_dir.rglob("*.xplane.pb"):
        for plane in _profile_data.ProfileData.from_file(str(path)).planes:
            for line in plane.lines:
                if "XLAEigen" not in line.name:
                    continue
                for event in line.events:
                    if not event.name.startswith(CONTAINERS):
                        times[event.name] += event.duration_ns
    return times


def _origin(hlo: str, name: str) -> str:
    """The thunk's HLO result shape and where it comes from (its op_name; for an instruction XLA
    added without one, e.g. a loop's copy, its opcode and operands)."""
    found = re.search(r"%" + re.escape(name) + r" = (\S+) ([^\n]*)", hlo)
    if not found:
        return ""
    named = re.search(r"op_name=\"([^\"]*)\"", found.group(2))
    origin = named.group(1).removeprefix("jit(train_step)/") if named else found.group(2).split(", metadata")[0]
    return f"{found.group(1).split('{')[0]} {origin[-80:]}"


def profile(overrides: list[str], steps: int, top: int) -> dict:
    import _steps

    config = _common.tiny_config(overrides)
    run, compiled, _, state, batches = _steps.prepare(config)
    for _ in range(3):
        state, metrics = compiled(state, next(batches))
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                state, metrics = compiled(state, next(batches))
            jax.block_until_ready(metrics)
        wall = (time.perf_counter() - start) / steps
        times = thunk_times(Path(tmp))
    by_kind = collections.Counter()
    for name, ns in times.items():
        by_kind[kind_of(name)] += ns
    hlo, gflop = compiled.as_text(), run.flops_per_token * config.train.global_batch_size * config.train.seq_len / 1e9
    return {"step_ms": wall * 1e3, "thunks_ms": sum(times.values()) / steps / 1e6, "model_gflop": gflop,
            "matmul_gflop_per_thread_s": gflop / (by_kind["matmul"] / steps / 1e9),
            "kinds_ms": {k: v / steps / 1e6 for k, v in by_kind.most_common()},
            "top": [{"thunk": n, "ms": v / steps / 1e6, "op": _origin(hlo, n)} for n, v in times.most_common(top)]}


def _table(shape: str, r: dict) -> str:
    rows = ["| kind | ms per step | share of thunk time |", "|---|---|---|"]
    rows += [f"| {k} | {v:.1f} | {v / r['thunks_ms']:.0%} |" for k, v in r["kinds_ms"].items()]
    rows += ["", "| largest thunks | ms per step | HLO result and origin |", "|---|---|---|"]
    rows += [f"| {t['thunk']} | {t['ms']:.2f} | `{t['op']}` |" for t in r["top"]]
    return (f"Shape {shape}: step {r['step_ms']:.1f} ms under the profiler, thunks {r['thunks_ms']:.1f} ms "
            f"(two threads); the model's {r['model_gflop']:.2f} GFLOP a step ran at "
            f"{r['matmul_gflop_per_thread_s']:.0f} GFLOP/s per thread in the matmul thunks.\n\n" + "\n".join(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    _common.add_flags(parser)
    args = parser.parse_args(argv)
    steps = 2 if args.smoke else args.steps
    result = {"benchmark": "cpu_profile", "shape": args.shape,
              **profile(SHAPES[args.shape] + (SMOKE if args.smoke else []) + args.override, steps, args.top)}
    text = _common.entry(f"Where XLA:CPU spends the train step, `{args.shape}`", _table(args.shape, result))
    _common.report(args, text, result)


if __name__ == "__main__":
    main()
