"""Where XLA:CPU spends a train step: a jax.profiler trace of compiled steps, each thunk's time
summed by what it does.

    python benchmarks/cpu_profile.py [--shape=tiny|gpt2] [--steps=10] [--top=12] [--override=a.b=v ...]
        [--json] [--append] [--smoke]

One fake CPU device; shapes as benchmarks/torch_reference.py. XLA:CPU is asked to mark each thunk
in the trace (--xla_cpu_enable_xprof_traceme); the thunks' durations are summed per step by kind:
matmuls (XNNPACK/YNNPACK fusions and dots), copies and transposes, broadcasts, slices into and
out of stacked arrays (a scanned loop's residuals), and the other fusions (elementwise, reductions).
Thunks run on several threads at once (one per core), so the kinds can add up past the step's
wall time. The largest single thunks are listed with the HLO operation they come from.

Then the same step by part of the model against PyTorch's (benchmarks/_torch_side.py in a process
of its own, from the same parameters and batches, torch.profiler's self time per operator): the attention kernel,
the other matmuls, the rest of the forward and backward passes (norms, activations, rotary, loss,
copies), and the optimizer with clipping and metrics. Run it on one core (`taskset -c 0`) to
compare the two in the same unit: each side then spends one thread's time, part by part.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import os

_common.fake_cpu_devices(1)
os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _worker  # noqa: E402
import jax  # noqa: E402
from _torch_side import PARTS  # noqa: E402
from torch_reference import SHAPES, SMOKE, hand_over, torch_env  # noqa: E402

from jaxscale.kernels import flash  # noqa: E402

KINDS = (("matmul", ("ynn_fusion", "xnn_fusion", "dot")), ("copy/transpose", ("copy", "transpose")),
         ("broadcast", ("broadcast",)), ("stacked slices", ("dynamic-slice", "dynamic-update-slice")))
# Events that are not one thunk's work: loops and calls around thunks, the executor and its pool,
# and the markers of a thunk's completion ("end: NAME").
CONTAINERS = ("while", "cond", "call", "ThunkExecutor", "SlinkyThreadPool", "end: ")
# Marks XLA:CPU's libraries leave inside a thunk's span, named Class::Method (a parallel copy's
# "Transpose::Execute" on the Eigen threads): counting them would count their thunk's time twice.
INSIDE = "::"


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
                    if not event.name.startswith(CONTAINERS) and INSIDE not in event.name:
                        times[event.name] += event.duration_ns
    return times




def part_of(kind: str, op_name: str) -> str:
    """Which part of the step an XLA thunk belongs to, by its kind and the jaxpr path it comes from:
    the attention kernel's ops sit under its named scope; the gradient's under jvp/transpose."""
    if flash.SCOPE in op_name:
        return PARTS[0]
    if kind == "matmul":
        return PARTS[1]
    return PARTS[2] if not op_name or op_name.startswith(("jvp(", "transpose(")) else PARTS[3]


def torch_parts(run, state, steps: int) -> dict:
    """PyTorch's step on the same parameters and batches, in a process of its own
    (benchmarks/_torch_side.py): ms per step by part (self time per operator, torch.profiler),
    its wall time per step, and its threads."""
    with tempfile.TemporaryDirectory() as tmp:
        hand_over(run, state, Path(tmp), 3 + steps)
        theirs = _worker.Worker([sys.executable, str(Path(__file__).with_name("_torch_side.py")), tmp],
                                env=torch_env())
        theirs.ask("time", 3)
        parts = theirs.ask("profile", steps)
        theirs.close()
    return parts


def op_names(hlo: str) -> dict[str, str]:
    """Each HLO instruction's op_name (the jaxpr path it comes from), by instruction name."""
    found = re.finditer(r"^\s*(?:ROOT )?%(\S+) = [^\n]*?op_name=\"([^\"]*)\"", hlo, re.MULTILINE)
    return {m.group(1): m.group(2).removeprefix("jit(train_step)/") for m in found}


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
    by_kind, by_part, hlo = collections.Counter(), collections.Counter(), compiled.as_text()
    names = op_names(hlo)
    for name, ns in times.items():
        kind = kind_of(name)
        by_kind[kind] += ns
        by_part[part_of(kind, names.get(name, ""))] += ns
    gflop = run.flops_per_token * config.train.global_batch_size * config.train.seq_len / 1e9
    return {"step_ms": wall * 1e3, "thunks_ms": sum(times.values()) / steps / 1e6, "model_gflop": gflop,
            "parts_ms": {p: by_part[p] / steps / 1e6 for p in PARTS},
            "torch": torch_parts(run, state, steps),
            "matmul_gflop_per_thread_s": gflop / (by_kind["matmul"] / steps / 1e9),
            "kinds_ms": {k: v / steps / 1e6 for k, v in by_kind.most_common()},
            "top": [{"thunk": n, "ms": v / steps / 1e6, "op": _origin(hlo, n)} for n, v in times.most_common(top)]}


def _versus_torch(r: dict) -> list[str]:
    t = r["torch"]
    pairs = [(p, r["parts_ms"][p], t["parts_ms"][p]) for p in PARTS] + [("the step, wall", r["step_ms"], t["step_ms"])]
    return [f"| part of the step | XLA:CPU thunks, ms | PyTorch ({t['threads']} threads), ms | ratio |",
            "|---|---|---|---|", *(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |"
                                   for name, ours, theirs in pairs)]


def _table(shape: str, r: dict) -> str:
    rows = ["| kind | ms per step | share of thunk time |", "|---|---|---|"]
    rows += [f"| {k} | {v:.1f} | {v / r['thunks_ms']:.0%} |" for k, v in r["kinds_ms"].items()]
    rows += ["", "| largest thunks | ms per step | HLO result and origin |", "|---|---|---|"]
    rows += [f"| {t['thunk']} | {t['ms']:.2f} | `{t['op']}` |" for t in r["top"]]
    rows += ["", *_versus_torch(r)]
    return (f"Shape {shape}: step {r['step_ms']:.1f} ms under the profiler, thunks {r['thunks_ms']:.1f} ms "
            f"(over {len(os.sched_getaffinity(0))} core(s)); the model's {r['model_gflop']:.2f} GFLOP a step ran at "
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
