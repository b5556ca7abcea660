"""Host offload: what keeping optimizer state (and parameters) in pinned host memory costs in step
time, against the device memory it frees.

    python benchmarks/offload.py [--config=configs/tiny.py] [--override=a.b=v ...] [--rounds=5]
        [--steps=10] [--json] [--append] [--smoke]

Three runs of the same model and mesh: nothing offloaded, `offload.optimizer_state`, and that
plus `offload.params`. Each compiles its step once; then rounds interleave them (`--steps` steps
each, timed to the last step's completion) and the table reports medians per step, the ratio to
no offload, and the state bytes each device holds in device and in host memory between steps.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse

import jax

from jaxscale import config as config_lib
from jaxscale.analysis.step_plan import shard_bytes
from jaxscale.offload import HOST

import _steps

MODES = {"none": {}, "optimizer_state": {"optimizer_state": True},
         "optimizer_state+params": {"optimizer_state": True, "params": True}}
WIDE = ["model.d_model=512", "model.d_ff=2048", "model.num_heads=8", "model.num_kv_heads=8"]
SMOKE = ["model.d_model=64", "model.d_ff=128", "train.seq_len=32", "train.global_batch_size=8"]


def _config(config, mode: dict):
    config = config.copy_and_resolve_references()
    config.offload.update(mode)
    return config


def measure(config, rounds: int, steps: int) -> dict:
    prepared = {name: _steps.stepper(_config(config, mode), steps) for name, mode in MODES.items()}
    medians = _steps.interleaved({name: s.timed for name, s in prepared.items()}, rounds)
    rows = []
    for name, s in prepared.items():
        state = (s.live["state"].params, s.live["state"].opt_state)
        host = shard_bytes(state, HOST)
        rows.append({"mode": name, "step_s": medians[name], "host_bytes": host,
                     "device_bytes": shard_bytes(state) - host})
    for row in rows:
        row["step_ratio"] = row["step_s"] / rows[0]["step_s"]
    return {"devices": jax.device_count(), "rounds": rounds, "steps": steps, "rows": rows}


def report(result: dict) -> str:
    return _common.entry(f"offload: state in host memory on {result['devices']} devices", "\n".join(
        ["| offloaded | median step | vs none | state on each device | in host memory |", "|---|---|---|---|---|"]
        + [f"| {r['mode']} | {r['step_s'] * 1e3:,.1f} ms | {r['step_ratio']:.3f} "
           f"| {_common.size_text(r['device_bytes'])} | {_common.size_text(r['host_bytes'])} |"
           for r in result["rows"]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    _common.add_flags(parser)
    args = parser.parse_args()
    overrides = (SMOKE if args.smoke else WIDE) + args.override + ["tracking.writers=jsonl", "train.eval_every=0"]
    rounds, steps = (1, 2) if args.smoke else (args.rounds, args.steps)
    config = config_lib.load(args.config)
    config_lib.apply_overrides(config, overrides)
    result = measure(config, rounds, steps)
    _common.report(args, report(result), {"benchmark": "offload", "config": args.config, "overrides": overrides,
                                          **result})


if __name__ == "__main__":
    main()
