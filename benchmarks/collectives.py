"""Collectives per mesh axis: time, algorithm and bus bandwidth over message sizes (nccl-tests style).

    python benchmarks/collectives.py [--mesh=data=2,fsdp=2,tensor=2] [--axes=tensor] [--sizes=1K,64K,4M]
        [--collectives=all-reduce,all-gather] [--repeats=10] [--iters=10] [--json] [--append] [--smoke]
        [--distributed [--coordinator=HOST:PORT --num_processes=N --process_id=I]]

`--mesh` names axis sizes as the config's `mesh.*` does (unnamed axes 1, one may be -1; default
every device on `data`). Each axis of size > 1 (or those in `--axes`) is measured on its own:
the collective runs inside `jax.shard_map` over the whole mesh but reduces/exchanges over that
axis only, so every group along the other axes runs it at the same time, as in training.

Sizes follow nccl-tests: SIZE (a `--sizes` entry, in bytes, float32 elements rounded down to a
multiple of the axis size n; the table shows the bytes used) is, per rank,
  all-reduce (psum)                 the buffer reduced (input = output = SIZE);
  all-gather                        the gathered output (each rank contributes SIZE/n);
  reduce-scatter (psum_scatter)     the input (each rank keeps SIZE/n of the reduced result);
  all-to-all                        the buffer sent (= received), SIZE/n to each rank;
  collective-permute (ring ppermute) the buffer each rank sends to its neighbour.
algbw = SIZE / time. busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather,
reduce-scatter and all-to-all, x 1 for collective-permute: the per-link rate of a ring that
would take that time, comparable with the hardware's link bandwidth.

Timing: each (axis, collective, size) is compiled first, run once to warm up, then called
`--repeats` times with block_until_ready; the time is the median call divided by `--iters`,
the collectives chained inside one call by lax.fori_loop to amortise dispatch. The all-gather
loop also slices its output back to the input (SIZE/n bytes) and the reduce-scatter loop writes
its result into its input (SIZE/n bytes), so their times include that much copying. The
compiled program is checked: `hlo` in each row counts the collectives XLA actually runs per call
(jaxscale.analysis.hlo_stats), which shows when a backend lowers one collective as another, and
`hlo_result_bytes` sums their per-device result sizes, which shows the size the program moves.
With several processes (--distributed) each times its own calls and process 0 reports.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import statistics
import sys
import time

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
KIB = 2**10
UNITS = {"": 1, "K": KIB, "M": KIB**2, "G": KIB**3}


def _bad(message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (as argparse and jaxscale's CLIs do)."""
    print(f"collectives.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_sizes(text: str) -> list[int]:
    """'1024,64K,4M' -> bytes (K, M, G are powers of 1024)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("IB").removesuffix("B")
        unit = item[-1] if item and item[-1] in UNITS else ""
        sizes.append(int(item.removesuffix(unit)) * UNITS[unit])
    return sizes


def default_sizes(backend: str) -> list[int]:
    """1 KiB to 64 MiB in powers of 4 on accelerators; to 4 MiB on CPU, where memory copies are slow."""
    top = 4 * KIB**2 if backend == "cpu" else 64 * KIB**2
    return [KIB * 4**k for k in range(20) if KIB * 4**k <= top]


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,tensor=4' -> sizes for every axis of jaxscale.mesh.AXES (unnamed axes 1)."""
    from jaxscale.mesh import AXES

    sizes = dict.fromkeys(AXES, 1)
    for item in filter(None, text.split(",")):
        axis, _, size = item.partition("=")
        if axis not in sizes:
            _bad(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)}")
        sizes[axis] = int(size)
    return sizes


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw, as nccl-tests defines it."""
    if collective == "all-reduce":
        return 2 * (n - 1) / n
    return 1.0 if collective == "collective-permute" else (n - 1) / n


def _body(collective: str, axis: str, n: int):
    """One collective over `axis` as a function from the per-rank carry to the same shape."""
    from jax import lax

    if collective == "all-reduce":
        return lambda x: lax.psum(x, axis)
    if collective == "all-gather":
        return lambda x: lax.all_gather(x, axis, tiled=True)[: x.shape[0]]
    if collective == "reduce-scatter":
        return lambda x: lax.dynamic_update_slice(x, lax.psum_scatter(x, axis, tiled=True), (0,))
    if collective == "all-to-all":
        return lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)
    ring = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: lax.ppermute(x, axis, ring)


def _program(mesh, collective: str, axis: str, iters: int, elements: int):
    """(compiled program, its per-rank input) running `iters` collectives per call."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    per_rank = elements // n if collective == "all-gather" else elements
    spec = P(mesh.axis_names)  # one flat block per device
    body = _body(collective, axis, n)
    program = jax.jit(jax.shard_map(lambda x: jax.lax.fori_loop(0, iters, lambda _, y: body(y), x),
                                    mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.jit(lambda: jnp.zeros(per_rank * mesh.size, jnp.float32), out_shardings=NamedSharding(mesh, spec))()
    return program.lower(x).compile(), x


def _median_call(compiled, x, repeats: int) -> float:
    import jax

    jax.block_until_ready(compiled(x))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(mesh, axis: str, collective: str, size: int, repeats: int, iters: int) -> dict:
    """One row: the per-collective time and bandwidths for SIZE bytes (see the module docstring)."""
    import jax

    from jaxscale.analysis.hlo_stats import collective_stats

    n = mesh.shape[axis]
    elements = max(size // 4 // n, 1) * n  # float32, a multiple of n
    compiled, x = _program(mesh, collective, axis, iters, elements)
    seconds = _median_call(compiled, x, repeats) / iters
    nbytes = elements * 4
    algbw = nbytes / seconds / 1e9
    stats = {kind: s for kind, s in collective_stats(compiled.as_text()).items() if s["count"]}
    if jax.process_index() == 0:
        print(f"{axis} {collective} {_common.size_text(nbytes)}: {seconds * 1e6:,.1f} µs", file=sys.stderr, flush=True)
    return {"axis": axis, "axis_size": n, "collective": collective, "bytes": nbytes, "time_s": seconds,
            "algbw_GBps": algbw, "bus_factor": bus_factor(collective, n),
            "busbw_GBps": algbw * bus_factor(collective, n), "hlo": {kind: s["count"] for kind, s in stats.items()},
            "hlo_result_bytes": {kind: s["bytes"] for kind, s in stats.items()}}


def table(rows: list[dict], mesh_text: str, iters: int, repeats: int) -> str:
    """The markdown entry: one row per measurement, and a line for any collective XLA lowered otherwise."""
    lines = ["| axis (n) | collective | size | time | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['axis']} ({r['axis_size']}) | {r['collective']} | {_common.size_text(r['bytes'])} | "
                     f"{r['time_s'] * 1e6:,.1f} µs | {r['algbw_GBps']:.3g} | {r['busbw_GBps']:.3g} |")
    lowered = sorted({(r["collective"], ", ".join(f"{k} x{v}" for k, v in r["hlo"].items()) or "nothing")
                      for r in rows if r["hlo"] != {r["collective"]: iters}})
    notes = [f"\nMesh {mesh_text}; float32; time = median of {repeats} calls / {iters} collectives chained "
             f"per call (lax.fori_loop). busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (all-gather, "
             f"reduce-scatter, all-to-all), x 1 (collective-permute)."]
    notes += [f"Compiled program for {name} runs {hlo} per call (expected {name} x{iters})." for name, hlo in lowered]
    return "\n".join(lines + notes)


def _collectives(text: str) -> list[str]:
    """The --collectives names, checked."""
    names = text.split(",")
    for name in names:
        if name not in COLLECTIVES:
            _bad(f"unknown collective {name!r}; choose from {', '.join(COLLECTIVES)}")
    return names


def _distributed(args) -> None:
    import jax

    if args.distributed:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=-1", help="axis sizes as in the config: data=2,tensor=4")
    parser.add_argument("--axes", default="", help="axes to measure (default: every axis of size > 1)")
    parser.add_argument("--sizes", default="", help="bytes per rank, e.g. 1K,64K,4M (default by backend)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--iters", type=int, default=10, help="collectives chained in one jitted call")
    parser.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() first")
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    _common.add_flags(parser)
    args = parser.parse_args()
    _distributed(args)
    import jax

    from jaxscale.errors import ConfigError
    from jaxscale.mesh import make_mesh

    if args.smoke:
        args.sizes, args.repeats, args.iters = "1K", 2, 2
    sizes = parse_sizes(args.sizes) if args.sizes else default_sizes(jax.default_backend())
    try:
        mesh = make_mesh(parse_mesh(args.mesh))
    except ConfigError as error:
        _bad(f"--mesh {error}")
    axes = args.axes.split(",") if args.axes else [a for a, n in mesh.shape.items() if n > 1] or ["data"]
    if unknown := set(axes) - set(mesh.shape):
        _bad(f"--axes names {', '.join(sorted(unknown))}; axes are {', '.join(mesh.shape)}")
    names = _collectives(args.collectives)
    rows = [measure(mesh, axis, name, size, args.repeats, args.iters)
            for axis in axes for name in names for size in sizes]
    mesh_text = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    text = _common.entry(f"collectives: mesh {mesh_text}",
                         table(rows, mesh_text, args.iters, args.repeats))
    _common.report(args, text, {"benchmark": "collectives", "mesh": dict(mesh.shape), "dtype": "float32",
                                "iters": args.iters, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
