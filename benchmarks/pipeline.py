"""Pipeline schedules: step time per schedule against the microbatch count, and each one's
measured idle share beside the bubble of the table it runs.

    python benchmarks/pipeline.py [--stages=2] [--schedules=gpipe,1f1b,zero_bubble,interleaved_1f1b]
        [--microbatches=4,8,16] [--steps=9] [--seq_len=256] [--layers=8] [--json] [--append] [--smoke]

Trains a tiny model of 8 layers (--layers) with mesh.pipeline=stages (mesh.data=1; interleaved and circular
schedules with 2 layer chunks per device) over a fixed global batch, for each schedule and
microbatch count M; every configuration is compiled once and the rounds interleave them. For
each schedule a least-squares line through step time against 1/M gives the time the same work
would take with no bubble (its intercept c); the measured idle share is 1 - c/t(M). Beside it:
the table's bubble (idle stage-ticks, each action one tick: the executor runs the table in
lockstep, so a tick lasts as long as its slowest action, which the table does not know), its
ticks, and the microbatches each stage holds at most (`in_flight`).
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse

import _steps

INTERLEAVED = ("circular", "interleaved_1f1b")


def _config(stages: int, schedule: str, count: int, batch: int, seq_len: int, layers: int):
    from jaxscale import config as config_lib

    config = config_lib.load("configs/tiny.py")
    config_lib.apply_overrides(config, [
        "mesh.data=1", f"mesh.pipeline={stages}", f"pipeline.microbatches={count}", f"model.num_layers={layers}",
        f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={2 if schedule in INTERLEAVED else 1}",
        f"train.global_batch_size={batch}", f"train.seq_len={seq_len}", "data.source=synthetic",
        "metrics.progress=False", "tracking.writers=jsonl", "model.dtype=float32"])
    return config


def _bubble_free(times: dict[int, float]) -> float:
    """The intercept of a line through step time against 1/M: the step with no bubble."""
    import numpy as np

    counts = sorted(times)
    return float(np.polyfit([1 / m for m in counts], [times[m] for m in counts], 1)[1])


def _permutes(compiled) -> int:
    """Stage-to-stage transfers the compiled step runs: one each way per tick of the table."""
    from jaxscale.analysis.hlo_stats import collective_stats

    return collective_stats(compiled.as_text())["collective-permute"]["count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b,zero_bubble,interleaved_1f1b")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds; each runs one step per configuration")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:  # a layer a stage: the tables, ticks and transfers do not depend on the layers
        args.schedules, args.microbatches, args.steps, args.seq_len, args.layers = "1f1b", "2,4", 1, 32, 2
    _common.fake_cpu_devices(args.stages)
    schedules, counts, p = args.schedules.split(","), [int(x) for x in args.microbatches.split(",")], args.stages
    batch = max(counts)
    steppers = {(s, m): _steps.stepper(_config(p, s, m, batch, args.seq_len, args.layers))
                for s in schedules for m in counts}
    times = _steps.interleaved({key: s.timed for key, s in steppers.items()}, args.steps)
    rows = []
    for schedule in schedules:
        work = _bubble_free({m: times[(schedule, m)] for m in counts})
        for m in counts:
            table = steppers[(schedule, m)].run.model.spec.strategy.table()
            rows.append({"schedule": schedule, "microbatches": m, "step_s": times[(schedule, m)],
                         "idle_share": 1 - work / times[(schedule, m)], "table_bubble": table.bubble(),
                         "ticks": table.ticks, "in_flight": int(table.in_flight().max()),
                         "hlo_permutes": _permutes(steppers[(schedule, m)].compiled)})
    lines = ["| schedule | M | median step | measured idle share | table's bubble | ticks | most in flight |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['schedule']} | {r['microbatches']} | {r['step_s'] * 1e3:,.0f} ms | {r['idle_share']:.2f} | "
              f"{r['table_bubble']:.2f} | {r['ticks']} | {r['in_flight']} |" for r in rows]
    title = (f"pipeline schedules: tiny model ({args.layers} layers, seq {args.seq_len}), P={p} on {p} x cpu, "
             f"global batch {batch}")
    _common.report(args, _common.entry(title, "\n".join(lines)),
                   {"benchmark": "pipeline", "stages": p, "global_batch": batch, "seq_len": args.seq_len,
                    "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
