"""Mixture of experts: step time of configs/tiny_moe.py against the dense model of equal active
parameters, and with its experts split over the `expert` axis.

    python benchmarks/moe.py [--config=configs/tiny_moe.py] [--devices=8] [--rounds=5] [--steps=5]
        [--json] [--append] [--smoke]

The dense model is the same config with model.moe.num_experts=0: every MLP has model.d_ff hidden
units, which tiny_moe sets to top_k x the experts' d_ff, so a token meets the same number of MLP
weights either way (the router's few are the difference). Rows: dense and MoE on data=devices,
MoE dropless (model.moe.capacity_factor=0) on data=devices, then MoE with expert=2, 4 and
`devices` (data the rest), and dropless with expert=`devices` (on CPU the ragged exchange is
emulated by padded all-to-alls: XLA:CPU has no ragged all-to-all). Each compiles once; rounds
interleave them (`--steps` steps each) and the table reports medians per step, the ratio to
dense, the compiled step's temporaries per device and the share of assignments the last step
dropped.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse

import _steps

SMOKE = ["train.seq_len=32", "train.global_batch_size=8", "model.num_layers=2"]  # one MoE layer


def layouts(devices: int, smoke: bool = False) -> dict[str, list[str]]:
    """Row name -> overrides; with smoke, dense and expert=2 only."""
    dropless = ["model.moe.capacity_factor=0"]
    if smoke:
        return {"dense, data": ["model.moe.num_experts=0"], "moe, expert=2": ["mesh.expert=2"]}
    rows = {"dense, data": ["model.moe.num_experts=0"], "moe, data": [], "moe dropless, data": dropless}
    for experts in sorted({2, 4, devices}):
        if experts <= devices and devices % experts == 0:
            rows[f"moe, expert={experts}"] = [f"mesh.expert={experts}"]
    rows[f"moe dropless, expert={devices}"] = [*dropless, f"mesh.expert={devices}"]
    return rows


def measure(config_path: str, overrides: list[str], devices: int, rounds: int, steps: int, smoke: bool = False) -> dict:
    from jaxscale import config as config_lib
    from jaxscale.analysis import mfu

    prepared = {}
    for name, extra in layouts(devices, smoke).items():
        config = config_lib.load(config_path)
        config_lib.apply_overrides(config, overrides + ["mesh.data=-1"] + extra)
        prepared[name] = _steps.stepper(config, steps)
    medians = _steps.interleaved({name: s.timed for name, s in prepared.items()}, rounds)
    rows = []
    for name, s in prepared.items():
        run, params = s.run, s.run.abstract_state.params
        rows.append({"layout": name, "step_s": medians[name], "mesh": dict(run.layout.mesh.shape),
                     "params": mfu.matmul_params(params, run.model.spec),
                     "active_params": mfu.active_params(params, run.model.spec),
                     "temp_bytes": s.compiled.memory_analysis().temp_size_in_bytes,
                     "dropped": float(s.live["metrics"].get("moe_dropped", 0.0))})
    for row in rows:
        row["step_ratio"] = row["step_s"] / rows[0]["step_s"]
    return {"devices": devices, "rounds": rounds, "steps": steps, "rows": rows}


def report(result: dict) -> str:
    header = ["| model, layout | median step | vs dense | non-embedding params | active per token "
              "| temporaries per device | assignments dropped |", "|---|---|---|---|---|---|---|"]
    return _common.entry(f"moe: against the dense model of equal active parameters on {result['devices']} devices",
                         "\n".join(header
                                   + [f"| {r['layout']} | {r['step_s'] * 1e3:,.1f} ms | {r['step_ratio']:.2f} "
                                      f"| {r['params']:,} | {r['active_params']:,} | "
                                      f"{_common.size_text(r['temp_bytes'])} | {r['dropped']:.1%} |"
                                      for r in result["rows"]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_moe.py")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    _common.add_flags(parser)
    args = parser.parse_args()
    _common.fake_cpu_devices(args.devices)
    overrides = (SMOKE if args.smoke else []) + ["tracking.writers=jsonl", "train.eval_every=0",
                                                 "metrics.progress=False"]
    rounds, steps = (1, 1) if args.smoke else (args.rounds, args.steps)
    result = measure(args.config, overrides, args.devices, rounds, steps, args.smoke)
    _common.report(args, report(result), {"benchmark": "moe", "config": args.config, "overrides": overrides, **result})


if __name__ == "__main__":
    main()
