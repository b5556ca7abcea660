"""How much of a step's communication its compiled schedule can hide behind compute.

A compiled module is scheduled: each computation's instructions are in the order they run. An
asynchronous collective is a start and a done (GPU: `all-gather-start`..`all-gather-done`,
`async-start`..`async-done`; the TPU compiler's continuation fusions: `%async-collective-start.N`
..`%async-collective-done.N`, stepping on inside the compute fusions between them); whatever
matmuls are scheduled between the two run while it is in flight. A collective that is not split
so blocks: nothing runs beside it. `windows` reads, for every collective one step runs, its bytes
and the matmul FLOPs beside it (a while body's collectives once per trip, a conditional's by its
branches' share, as jaxscale.analysis.hlo_stats counts them). A collective started in one trip of
a loop and finished in the next (pipelined collectives) has beside it the rest of that trip and
the start of the next. Matmuls in flight beside several collectives are shared among them equally:
no FLOP hides two of them.

`hidden` prices them on a machine (jaxscale.analysis.cost.Machine): a collective takes its bytes
over the slowest link its axes cross plus a latency; the compute beside it takes its FLOPs at the
machine's matmul rate; the smaller of the two is hidden, the rest exposed. Where a host's cores
play every device (CPU), nothing is hidden.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxscale.analysis import device_groups, hlo_stats
from jaxscale.analysis.plan_types import AxisOverlap, Window

Counts = dict[tuple[str, int, float], float]  # (collective key, result bytes, FLOPs beside) -> runs


def windows(computations: dict, entry: str, mesh_shape: Mapping[str, int]) -> tuple[Window, ...]:
    """Every collective one call of a parsed program (`hlo_stats.parse_module`) is expected to run
    (a conditional's branches by their share), with the matmul FLOPs scheduled beside it, grouped:
    (axes, kind, bytes sent a run, FLOPs beside a run, runs)."""
    rows: dict[tuple[str, str, float, float], float] = {}
    for (key, nbytes, beside), runs in _Schedule(computations).counts(entry).items():
        kind, spec = key.split(hlo_stats.AT, 1)
        axes, size = device_groups.describe(spec, mesh_shape)
        if axes in ("", device_groups.NONE):
            continue
        row = (axes, kind, device_groups.sent_bytes(kind, nbytes, size), beside)
        rows[row] = rows.get(row, 0.0) + runs
    return tuple(Window(axes=a, kind=k, sent_bytes=sent, flops_beside=f, runs=r)
                 for (a, k, sent, f), r in sorted(rows.items()))


class _Schedule:
    """A parsed module's computations, read for their collectives and what runs beside them;
    each computation's FLOPs and collectives are worked out once."""

    def __init__(self, computations: dict):
        self.computations = computations
        self._totals: dict = {}                 # hlo_stats.computation_totals' memo
        self._flops: dict[str, float] = {}
        self._counts: dict[str, Counts] = {}

    def matmul_flops(self, name: str) -> float:
        """Matmul FLOPs of one run of computation `name`, callees included."""
        if name not in self._flops:
            totals = hlo_stats.computation_totals(name, self.computations, self._totals, expected=True)
            self._flops[name] = float(totals.get("dot", [0, 0])[1] + totals.get("convolution", [0, 0])[1])
        return self._flops[name]

    def own(self, name: str) -> Counts:
        """The collectives computation `name` itself runs, each with the FLOPs beside it."""
        done, in_flight, beside = {}, {}, {}  # start name -> (key, bytes); accumulated FLOPs
        own: Counts = {}

        def compute(amount: float) -> None:
            for start in in_flight:
                beside[start] += amount / len(in_flight)

        # Twice round: a collective a loop's trip starts and the next trip finishes (pipelined)
        # meets its done on the second pass; only starts of the first pass are windows.
        for lap in (0, 1):
            for event in self.computations[name].events:
                tag = event[0]
                if tag == "start" and lap == 0:
                    in_flight[event[1]], beside[event[1]] = (event[2], event[3]), 0.0
                elif tag == "done" and event[1] in in_flight:
                    done[event[1]] = (*in_flight.pop(event[1]), beside.pop(event[1]))
                elif tag == "sync" and lap == 0:
                    key = (event[1], event[2], 0.0)
                    own[key] = own.get(key, 0.0) + 1
                elif tag == "flops":
                    compute(event[1])
                elif tag == "call":
                    compute(event[2] * self.matmul_flops(event[1]))
        for key, nbytes, amount in [*done.values(), *((k, b, beside[s]) for s, (k, b) in in_flight.items())]:
            row = (key, nbytes, float(round(amount)))
            own[row] = own.get(row, 0.0) + 1
        return own

    def counts(self, name: str) -> Counts:
        """The collectives of one run of computation `name`, callees included (a continuation of
        another's collective is not one)."""
        if name not in self._counts:
            total, computation = self.own(name), self.computations[name]
            for callee, runs, share in computation.calls:
                if callee in computation.compute_only or callee in computation.wrapped:
                    continue  # a continuation of a collective, or the one a start event stands for
                for row, n in self.counts(callee).items():
                    total[row] = total.get(row, 0.0) + runs * share * n
            self._counts[name] = total
        return self._counts[name]


def by_axis(windows_: tuple[Window, ...], machine=None, link=None) -> dict[str, AxisOverlap]:
    """Per mesh axes: bytes sent, bytes sent beside matmuls, those matmuls' FLOPs and, given a
    machine and `link(axes) -> bytes/s`, the bytes their compute hides and the exposed rest."""
    table: dict[str, dict[str, float]] = {}
    for w in windows_:
        row = table.setdefault(w.axes, {"sent_bytes": 0.0, "async_bytes": 0.0, "flops_beside": 0.0})
        row["sent_bytes"] += w.sent_bytes * w.runs
        row["async_bytes"] += w.sent_bytes * w.runs if w.flops_beside else 0.0
        row["flops_beside"] += w.flops_beside * w.runs
        if machine is not None:
            hidden_s, comm_s = hidden_seconds(w, machine, link(w.axes))
            row["hidden_bytes"] = row.get("hidden_bytes", 0.0) + w.sent_bytes * w.runs * hidden_s / comm_s
    for row in table.values():
        if "hidden_bytes" in row:
            row["exposed_bytes"] = row["sent_bytes"] - row["hidden_bytes"]
    return {axes: AxisOverlap(**row) for axes, row in sorted(table.items())}


def hidden_seconds(w: Window, machine, link_bytes_per_s: float) -> tuple[float, float]:
    """(seconds of one run of the collective hidden behind its compute, its seconds in all) on `machine`."""
    comm = w.sent_bytes / link_bytes_per_s + machine.latency_s
    if machine.shared_cores:
        return 0.0, comm
    return min(comm, w.flops_beside / (machine.peak_flops * machine.efficiency)), comm
