"""The layout search's step-time model against measured steps, and its calibration on GPU numbers.

    python benchmarks/search.py [--compile=1] [--rounds=11] [--append]      # tiny, 8 fake CPU devices
    JAX_PLATFORMS=cpu PYTHONPATH=.venv/gpu-plan python benchmarks/search.py --calibrate [--append]

Default: `plan --search --spread` for configs/tiny.py on this host's 8 fake CPU devices compiles
its `--compile` best candidates, the best of each combination of split axes (distinct layouts:
variants that differ only in a ZeRO stage run nearly the same program, whose order is noise), and
pure FSDP; each is then built, compiled with the CLI's XLA flags and stepped, all taking turns for
`--rounds` rounds. Reported: the predicted and measured step of each, Spearman's rank correlation
between the two, the same correlation between the medians of the odd and the even rounds (how
well the measurement agrees with itself: the most any model can reach), and the measured step of
the layout the search ranks first against the fastest measured.

--calibrate: llama_1b (batch 8, seq 2048, dots_saveable) and gpt2_124m (batch 16, seq 2048)
compiled for one H200 by XLA's GPU compiler; the matmul efficiency that makes the model predict
llama_1b's measured 291 ms, and gpt2_124m's prediction with it against its measured 108 ms.
"""

from __future__ import annotations

import _common

import argparse
import dataclasses
import statistics

SMOKE = ["train.global_batch_size=8", "train.seq_len=32", "model.d_model=64", "model.d_ff=128"]
MEASURED_GPU = {"configs/llama_1b.py": (["train.global_batch_size=8", "train.seq_len=2048",
                                         "model.remat='dots_saveable'"], 0.291),
                "configs/gpt2_124m.py": (["train.global_batch_size=16", "train.seq_len=2048",
                                          "model.max_seq_len=2048", "model.remat='none'"], 0.108)}

# The entry's machine label: its step times are the H200's, only the compiling runs on this host.
MEASURED_ON = "steps measured on 1 x NVIDIA H200 (benchmarks/gpu.py, jax 0.11.2)"


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected in measured times)."""
    import numpy as np

    ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def cpu(args) -> None:
    import jax

    from jaxscale.analysis import search
    from jaxscale.plan import search_target

    import _steps

    overrides = SMOKE if args.smoke else []
    config = _common.tiny_config(overrides)
    target = search_target()
    rows = search.search(config, target, count=args.compile, workers=1, spread=not args.smoke).rows
    steppers = {}
    for row in rows:
        layout = search.with_overrides(config, row.layout.overrides())
        steppers[row.layout.describe()] = _steps.stepper(layout, steps=args.steps).timed
    rounds = _steps.interleaved_rounds(steppers, args.rounds)
    measured = {n: statistics.median(t) for n, t in rounds.items()}
    names = list(steppers)
    predicted = {r.layout.describe(): r.prediction.step_s for r in rows}
    rho = _spearman([predicted[n] for n in names], [measured[n] for n in names]) if len(names) > 1 else None
    itself = None  # the odd rounds' medians against the even rounds'
    if len(names) > 1 and args.rounds > 1:
        itself = _spearman(*([statistics.median(rounds[n][start::2]) for n in names] for start in (0, 1)))
    fastest = min(measured.values())
    lines = ["| rank | layout | predicted ms | measured ms |", "|---:|---|---:|---:|"]
    lines += [f"| {i} | {n} | {predicted[n] * 1e3:.1f} | {measured[n] * 1e3:.1f} |" for i, n in enumerate(names, 1)]
    text = _common.entry(
        f"tiny on {jax.device_count()} CPU devices",
        "\n".join(lines) + "\n\nSpearman's rank correlation, predicted against measured: "
        f"**{'-' if rho is None else f'{rho:.2f}'}** (the odd rounds' medians against the even rounds': "
        f"{'-' if itself is None else f'{itself:.2f}'}); the "
        f"layout ranked first measured {measured[names[0]] / fastest:.2f}x the fastest measured "
        f"({len(names)} layouts, median of {args.rounds} rounds of {args.steps} steps each, taking turns).\n"
        + "\n".join(f"Assumed: {a}." for a in target.machine.assumptions) + "\n")
    _common.report(args, text, {"benchmark": "search", "rows": [
        {"layout": n, "predicted_s": predicted[n], "measured_s": measured[n]} for n in names],
        "spearman": rho, "odd_against_even_rounds": itself, "first_over_fastest": measured[names[0]] / fastest})


def calibrate(args) -> None:
    from jaxscale import cli
    from jaxscale.analysis import cost, machines, topology
    from jaxscale.plan import compile_plan, describe

    devices, pod = topology.compile_only_devices("h200-1")
    ideal = dataclasses.replace(machines.for_pod(pod, devices), efficiency=1.0)
    rows, efficiency = [], None
    for path, (overrides, measured_s) in MEASURED_GPU.items():
        config = cli.load_config(str(_common.ROOT / path), overrides + ["mesh.data=1"])
        work = describe(config, *compile_plan(config, "gpu", devices)).work
        p = cost.predict(work, ideal)
        if efficiency is None:  # the first (llama_1b) calibrates
            efficiency = p.compute_s / (measured_s - p.memory_s - p.exposed_s)
        predicted = p.compute_s / efficiency + p.memory_s + p.exposed_s
        rows.append({"config": path, "matmul_tflop": cost.matmul_flops(work) / 1e12, "memory_ms": p.memory_s * 1e3,
                     "measured_ms": measured_s * 1e3, "predicted_ms": predicted * 1e3})
    lines = ["| config | matmul TFLOP a step | memory term ms | measured ms | predicted ms |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['matmul_tflop']:.1f} | {r['memory_ms']:.1f} | {r['measured_ms']:.0f} | "
              f"{r['predicted_ms']:.0f} |" for r in rows]
    text = _common.entry("GPU calibration on one H200", "\n".join(lines) + f"\n\nCompiled here for an H200 by XLA's "
                         "GPU compiler; the measured steps are the H200 runs of benchmarks/gpu.py. Matmul efficiency "
                         f"calibrated on llama_1b: **{efficiency:.3f}** of the H200's 989 TFLOP/s "
                         "(jaxscale.analysis.machines).\n")
    text = text.replace("; machine: ", f"; machine: {MEASURED_ON}; compiled for it on ", 1)
    _common.report(args, text, {"benchmark": "search", "efficiency": efficiency, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", type=int, default=1, help="best candidates the search compiles (beside "
                        "the best of each combination of split axes)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3, help="steps a timed call")
    parser.add_argument("--calibrate", action="store_true", help="the GPU calibration instead")
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        args.compile, args.rounds, args.steps = 1, 1, 1
    if args.calibrate:
        calibrate(args)
        return
    _common.fake_cpu_devices(8)
    cpu(args)


if __name__ == "__main__":
    main()
