"""GPipe: step time against the microbatch count at a fixed number of stages, and the bubble.

    python benchmarks/pipeline.py [--stages=2] [--microbatches=2,4,8,16] [--steps=9] [--virtual_stages=1]
        [--seq_len=256] [--json] [--append] [--smoke]

Trains a 4-layer tiny model with mesh.pipeline=stages (and mesh.data=1) over a fixed global
batch, for each microbatch count M. GPipe runs M+P-1 ticks of B/M sequences each, of which P-1
are bubble, so the step time should follow  t(M) = c + c(P-1)/M. A least-squares line through
t against 1/M gives the bubble-free time c (its intercept); the table compares the measured idle
share 1 - c/t(M) with the formula (P-1)/(M+P-1). `--json` prints the rows (microbatches,
step_s, idle_share, formula, and hlo_permutes: the stage-to-stage transfers the compiled step
runs) and the fit (work_s, slope_s, bubble_ratio against formula_ratio).
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse

import _steps


def _config(stages: int, count: int, batch: int, virtual: int, seq_len: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    config_lib.apply_overrides(config, [
        "mesh.data=1", f"mesh.pipeline={stages}", f"pipeline.microbatches={count}", f"model.num_layers={4 * virtual}",
        f"pipeline.schedule={'circular' if virtual > 1 else 'gpipe'}", f"pipeline.virtual_stages={virtual}",
        f"train.global_batch_size={batch}", f"train.seq_len={seq_len}", "data.source=synthetic",
        "metrics.progress=False", "tracking.writers=jsonl", "model.dtype=float32"])
    return config


def _fit(times: dict[int, float]) -> dict:
    """GPipe/circular: t(M) = c + c(P-1)/(V M). A line through t against 1/M; c is the bubble-free time."""
    import numpy as np

    counts = sorted(times)
    slope, work = np.polyfit([1 / m for m in counts], [times[m] for m in counts], 1)
    return {"work_s": float(work), "slope_s": float(slope), "bubble_ratio": float(slope / work)}


def _permutes(compiled) -> int:
    """Stage-to-stage transfers the compiled step runs: one per tick each way, so GPipe's count is
    2 (M + P - 1), the ticks the bubble formula assumes."""
    from jaxscale.profile import collective_stats

    return collective_stats(compiled.as_text())["collective-permute"]["count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds; each runs one step per M")
    parser.add_argument("--virtual_stages", type=int, default=1, help="1: gpipe; >1: the circular schedule")
    parser.add_argument("--seq_len", type=int, default=256)
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        args.microbatches, args.steps, args.seq_len = "2,4", 1, 32
    _common.fake_cpu_devices(args.stages)
    from jaxscale.parallel.pipeline import bubble_fraction

    counts = [int(x) for x in args.microbatches.split(",")]
    batch, v, p = max(counts), args.virtual_stages, args.stages
    steppers = {m: _steps.stepper(_config(p, m, batch, v, args.seq_len)) for m in counts}
    times = _steps.interleaved({m: s.timed for m, s in steppers.items()}, args.steps)
    fit = {**_fit(times), "formula_ratio": (p - 1) / v}
    rows = [{"microbatches": m, "step_s": times[m], "idle_share": 1 - fit["work_s"] / times[m],
             "formula": bubble_fraction(p, m, v), "hlo_permutes": _permutes(steppers[m].compiled)}
            for m in counts]
    name = f"circular V={v}" if v > 1 else "gpipe"
    lines = ["| microbatches M | median step | measured idle share | formula (P-1)/(V*M+P-1) |", "|---|---|---|---|"]
    lines += [f"| {r['microbatches']} | {r['step_s'] * 1e3:,.0f} ms | {r['idle_share']:.2f} | {r['formula']:.2f} |"
              for r in rows]
    lines.append(f"\nFit: t(M) = {fit['work_s'] * 1e3:,.0f} ms + {fit['slope_s'] * 1e3:,.0f} ms / M, i.e. "
                 f"(P-1)/V = {fit['bubble_ratio']:.2f} (formula {fit['formula_ratio']:.2f}).")
    title = (f"{name}: tiny model ({4 * v} layers, seq {args.seq_len}), P={p} on {p} x cpu, "
             f"global batch {batch}")
    _common.report(args, _common.entry(title, "\n".join(lines)),
                   {"benchmark": "pipeline", "stages": p, "virtual_stages": v, "global_batch": batch,
                    "seq_len": args.seq_len, "steps": args.steps, "rows": rows, "fit": fit})


if __name__ == "__main__":
    main()
