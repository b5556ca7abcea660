"""Per-device memory by layout: the compiled train step's state bytes against the arithmetic.

    python benchmarks/memory.py [--config=configs/tiny.py] [--override=a.b=value ...]
        [--layout=data=8,zero_stage=1 ...] [--platform=gpu] [--json] [--append] [--smoke]

For each layout (mesh axis sizes, unnamed axes 1, and optionally zero_stage) this runs the
planner (`jaxscale.plan.make_plan`): the real train step compiled ahead of time, nothing
allocated. Per device it reports the parameter, gradient and optimizer-state bytes of the
compiled program's shardings beside the arithmetic (params 4N, grads 4N, Adam 8N, each divided
by the devices that split it), their ratio (1.00 = as the arithmetic says), and the temporary
and total bytes from `compiled.memory_analysis()` (total = arguments + temporaries + outputs not
aliased to donated inputs), and the collectives one step runs (kind x count, result bytes per
device, from the compiled HLO; XLA:CPU writes a reduce-scatter as an all-reduce and a slice).
A layout the config cannot take (heads not divisible, too few
devices) gets a row with the error instead of numbers.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import sys

STATE = ("params", "grads", "opt_state")
LAYOUTS = ["data=8", "data=8,zero_stage=1", "data=8,zero_stage=2", "data=8,zero_stage=3", "fsdp=8",
           "data=2,fsdp=4", "fsdp=2,tensor=4", "pipeline=2,data=4"]
SMOKE_LAYOUTS = ["data=8,zero_stage=1", "data=2,fsdp=4"]


def layout_overrides(layout: str) -> list[str]:
    """'data=2,fsdp=4,zero_stage=1' -> config overrides: every mesh axis 1 unless named."""
    from jaxscale.mesh import AXES

    overrides = [f"mesh.{axis}=1" for axis in AXES]
    for item in filter(None, layout.split(",")):
        key = item.partition("=")[0]
        overrides.append(f"mesh.{item}" if key in AXES else item)
    return overrides


def measure(config_path: str, overrides: list[str], layout: str, platform: str | None) -> dict:
    """One row: the plan's per-device bytes, the arithmetic and their ratio (or the error)."""
    import math

    import jax

    from jaxscale import config as config_lib
    from jaxscale.errors import ConfigError
    from jaxscale.plan import make_plan

    config = config_lib.load(config_path)
    try:
        config_lib.apply_overrides(config, overrides + layout_overrides(layout))
        sizes = [int(config.mesh[axis]) for axis in config.mesh]
        devices = jax.devices() if -1 in sizes else jax.devices()[:math.prod(sizes)]  # -1: all of them
        plan = make_plan(config, platform, devices)
    except ConfigError as error:
        return {"layout": layout, "error": str(error)}
    got, want = plan["per_device_bytes"], plan["expected_bytes"]
    return {"layout": layout, "mesh": {k: v for k, v in plan["mesh"].items() if v > 1},
            "zero_stage": plan["zero_stage"], "num_params": plan["num_params"], "compile_s": plan["compile_s"],
            "per_device_bytes": got, "expected_bytes": want, "ratio": {k: got[k] / want[k] for k in STATE},
            "collectives": {k: v for k, v in plan["collectives"].items() if v["count"]}}


def table(rows: list[dict], config_text: str) -> str:
    """The markdown entry: compiled / arithmetic (ratio) per state part, then temp and total."""
    size = _common.size_text
    lines = ["| layout | params: compiled / arithmetic | grads | optimizer state | temp | total | collectives |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['error']} | | | | | |")
            continue
        got, want = r["per_device_bytes"], r["expected_bytes"]
        cells = [f"{size(got[k])} / {size(want[k])} ({r['ratio'][k]:.2f})" for k in STATE]
        sent = ", ".join(f"{k} {v['count']}x {size(v['bytes'])}" for k, v in r["collectives"].items())
        lines.append(f"| {r['layout']} | " + " | ".join(cells) + f" | {size(got['temp'])} | {size(got['total'])} "
                     f"| {sent} |")
    lines.append(f"\n{config_text}; per device; ratio = compiled / arithmetic; temp and total from "
                 "memory_analysis() of the compiled step.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    parser.add_argument("--layout", action="append", default=[],
                        help="mesh axes and zero_stage, e.g. data=2,fsdp=4,zero_stage=1 "
                             f"(default: {' '.join(LAYOUTS)})")
    parser.add_argument("--platform", default=None, help="plan for cpu|gpu|tpu (compute dtype); default: this backend")
    _common.add_flags(parser)
    args = parser.parse_args()
    layouts = args.layout or (SMOKE_LAYOUTS if args.smoke else LAYOUTS)
    rows = []
    for layout in layouts:
        rows.append(measure(args.config, args.override, layout, args.platform))
        print(f"{layout}: {rows[-1].get('ratio', rows[-1].get('error'))}", file=sys.stderr, flush=True)
    config_text = " ".join([f"`{args.config}`"] + [f"`{o}`" for o in args.override])
    text = _common.entry(f"memory per device: {config_text}", table(rows, config_text))
    _common.report(args, text, {"benchmark": "memory", "config": args.config, "overrides": args.override,
                                "rows": rows})


if __name__ == "__main__":
    main()
