"""MaxText's compiled train step read by jaxscale's own readers: per-chip memory, collectives by
kind, the bytes each chip sends and the bytes its schedule leaves exposed, as `python -m
jaxscale.plan --json --topology=...` reports them for jaxscale's step (benchmarks/results/pods.md
sets the two side by side).

    python benchmarks/maxtext_plan.py --maxtext_python=MAXTEXT_VENV/bin/python -- \\
        compile_topology=v5p-256 compile_topology_num_slices=1 model_name=llama3-8b \\
        per_device_batch_size=1 max_target_length=2048 remat_policy=full ici_fsdp_parallelism=-1 \\
        skip_jax_distributed_system=True enable_checkpointing=False dataset_type=synthetic

MaxText compiles in its own venv and process (`pip install 'maxtext[tpu]'` there; Python 3.12)
through benchmarks/_maxtext_compile.py, which writes the compiled module's text and its
memory_analysis; this process reads them with jaxscale.analysis (hlo_stats, device_groups,
overlap) and prices the overlap at the topology's rates (jaxscale.analysis.machines), as the plan
does. `--read=DIR` reads a step written before. `--smoke` writes a tiny jaxscale step on 8 CPU
devices in the same form, reads it back, and gives the plan's account of the same program beside
it (they must agree). Needs libtpu here for a TPU topology's rates.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _maxtext_compile import write_step

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maxtext_python", default=os.environ.get("MAXTEXT_PYTHON", ""),
                        help="the Python of MaxText's venv (default: $MAXTEXT_PYTHON)")
    parser.add_argument("--read", default="", help="a step written before (step.hlo, step.json) instead of compiling")
    parser.add_argument("--out", default="", help="where MaxText's step is written (default: a temporary folder)")
    parser.add_argument("maxtext_args", nargs="*", help="train_compile's arguments, after --")
    _common.add_flags(parser)
    args = parser.parse_args()
    if args.smoke:
        _common.fake_cpu_devices(8)
        out = _smoke()
    else:
        folder = Path(args.read or args.out or tempfile.mkdtemp(prefix="maxtext-step-"))
        if not args.read:
            _compile(args.maxtext_python, folder, args.maxtext_args)
        meta = json.loads((folder / "step.json").read_text())
        out = {"args": meta["args"], **read(folder, _machine(meta["args"]))}
    text = _common.entry("MaxText " + " ".join(out["args"]), _table(out))
    _common.report(args, text, {"benchmark": "maxtext_plan", **out})


def _compile(python: str, folder: Path, maxtext_args: list[str]) -> None:
    if not python:
        sys.exit("benchmarks/maxtext_plan.py: --maxtext_python is empty; give MaxText's venv's Python "
                 "(python3.12 -m venv V && V/bin/pip install 'maxtext[tpu]') or --read=DIR")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    script = Path(__file__).with_name("_maxtext_compile.py")
    subprocess.run([python, str(script), str(folder), *maxtext_args], env=env, check=True)


def _machine(maxtext_args: list[str]):
    """The topology's rates (jaxscale.analysis.machines), from train_compile's compile_topology."""
    from jaxscale.analysis import machines, topology

    named = dict(a.split("=", 1) for a in maxtext_args if "=" in a)
    slices = int(named.get("compile_topology_num_slices", 1))
    name = named["compile_topology"]
    devices, pod = topology.compile_only_devices(f"{slices}x{name}" if slices > 1 else name)
    return machines.for_pod(pod, devices)


def read(folder: Path, machine=None) -> dict:
    """A written step's per-chip memory, collectives and overlap, read as jaxscale's plan reads its own."""
    from jaxscale.analysis import cost, hlo_stats, overlap
    from jaxscale.analysis.plan_types import by_axis, to_json

    meta = json.loads((folder / "step.json").read_text())
    mesh, memory = meta["mesh"], meta["memory"]
    computations, entry = hlo_stats.parse_module((folder / "step.hlo").read_text(), {})
    totals = hlo_stats.module_totals(computations, entry, False)
    link = None if machine is None else (lambda axes: cost.link_speed(machine, axes, mesh, {}))
    rows = overlap.by_axis(overlap.windows(computations, entry, mesh), machine, link)
    sent = {kind: sum(r["sent_bytes"] for r in over.values()) for kind, over in totals.by_axis(mesh).items()}
    total = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] + memory["temp_size_in_bytes"]
             - memory["alias_size_in_bytes"])
    exposed = [r.exposed_bytes for r in rows.values() if r.exposed_bytes is not None]
    return {"mesh": {k: v for k, v in mesh.items() if v > 1}, "compile_s": meta["compile_s"],
            "memory": memory, "total_bytes": total, "collectives": to_json(totals.collectives),
            "collectives_by_axis": to_json(by_axis(totals.by_axis(mesh))), "sent_bytes_by_kind": sent,
            "sent_bytes": sum(sent.values()), "overlap": to_json(rows),
            "exposed_bytes": sum(exposed) if machine is not None else None}


def _smoke() -> dict:
    """A tiny jaxscale step written as MaxText's is, read back, beside the plan's account of it."""
    from jaxscale.plan import compile_plan, describe

    config = _common.tiny_config(["mesh.data=2", "mesh.fsdp=4", "model.num_layers=1"])
    run, compiled, seconds = compile_plan(config, "cpu")
    plan = describe(config, run, compiled, seconds).to_json()
    with tempfile.TemporaryDirectory(prefix="maxtext-smoke-") as folder:
        write_step(Path(folder), compiled, dict(run.layout.mesh.shape), seconds, ["smoke"])
        written = read(Path(folder))
    return {"args": ["smoke"], **written, "plan": {k: plan[k] for k in ("collectives", "collectives_by_axis",
                                                                        "compiled_bytes", "overlap")}}


def _table(out: dict) -> str:
    rows = [f"mesh {out['mesh']}, compiled in {out['compile_s']} s",
            "| per chip | MaxText |", "|---|---|",
            f"| temporaries | {out['memory']['temp_size_in_bytes'] / GIB:.2f} GiB |",
            f"| total | {out['total_bytes'] / GIB:.2f} GiB |"]
    for kind, row in out["collectives"].items():
        if row["count"]:
            rows.append(f"| {kind}s | {row['count']:,}, {out['sent_bytes_by_kind'][kind] / GIB:.3g} GiB sent |")
    rows.append(f"| bytes sent | {out['sent_bytes'] / GIB:.1f} GiB |")
    if out["exposed_bytes"] is not None:
        rows.append(f"| exposed | {out['exposed_bytes'] / GIB:.2f} GiB |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
