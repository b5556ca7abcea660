"""What one step of a compiled XLA program does, read from its HLO text: the collectives it runs
(count and bytes per kind) and the FLOPs of its matrix multiplies.

Feed it ``jax.jit(f).lower(*args).compile().as_text()`` (the post-optimisation HLO
module text) to learn how many collectives one call of the program executes and
how many bytes they produce, per kind::

    stats = collective_stats(compiled.as_text())
    print(summarize(stats))

Counting rules (the contract every function here follows):

* Only computations reachable from the ENTRY computation count; ENTRY runs once.
* A ``while`` body runs ``known_trip_count`` times (from the instruction's
  backend_config) and its condition one time more. The TPU compiler leaves that
  field out; there a loop whose condition is ``ROOT compare(counter, constant(N)),
  direction=LT`` runs N times (JAX's scans count from 0 in steps of 1). Any other
  loop counts once and is reported as unknown by `collective_stats_detail`.
* The TPU compiler fuses a reduce-scatter as an all-reduce and a slice in a
  custom fusion calling ``%all-reduce-scatter...``: it counts as one
  reduce-scatter, with the fusion's result bytes.
* ``calls=``, ``to_apply=``, ``branch_computations=``, ``true_computation=``,
  ``false_computation=`` and ``called_computations=`` callees run once per run of
  their caller. Every branch of a conditional is counted: an upper bound, since
  the HLO text cannot say which branch is taken. ``step_totals(text, expected=True)``
  counts each of a conditional's n branches 1/n times instead: the expected run
  when every branch is as likely (a causal block's skip), or, for a conditional made
  directly in a name scope named in ``shares``, branch i shares[scope][i] times (a
  pipeline executor's switch, whose shares its schedule's table knows).
* An instruction whose attributes break over lines (a Pallas kernel's metadata) is one line.
* Async collectives count once, at their ``-start``; ``-done`` is skipped. The TPU
  compiler's continuation fusions (``%async-collective-start.N``, then fusions calling
  ``async_collective_fusion`` computations, then ``%async-collective-done.N``) each hold a
  copy of one collective: it counts once, in the start.
* Bytes are those of the collective's result buffers on one device, summed. A ragged
  all-to-all moves what the routing decides at run time, at most the smaller of its operand
  and its result (what a device holds to send, what it has room to receive): that bound is
  its bytes.
* `step_totals` also keeps each collective's device groups (`jaxscale.analysis.device_groups` reads
  which mesh axes they span); a fused reduce-scatter takes its inner all-reduce's groups.
* `dot_flops` counts 2 x (result elements) x (contracted elements) per ``dot``,
  under the same rules: a layer loop's matmuls count once per layer, and
  rematerialised ones again (XLA's own cost analysis counts a loop body once). A
  ``convolution``'s FLOPs (the TPU compiler's matmuls) are 2 x result elements x the
  kernel's input features x the window taps that read the input, not its padding; they are
  kept apart (`computation_totals`), for jaxscale.analysis.overlap.
* Each computation also keeps its schedule: its collectives' starts and dones, blocking
  collectives, matmuls and calls in the order they run (jaxscale.analysis.overlap reads it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence

from jaxscale.analysis import device_groups

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all")

Stats = dict[str, dict[str, int]]
Shares = Mapping[str, Sequence[float]] | None  # {name scope: each branch's share} (module docstring)
AT = "@"  # a collective's key in a computation's totals: kind@device-groups

# Quoted strings (metadata, backend_config JSON) and /*index=N*/ comments: both can
# hold text that looks like shapes, opcodes or callee attributes.
_STRING_OR_COMMENT = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/')
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_HEADER = re.compile(r"(ENTRY\s+)?%?([^\s(){}]+)")
_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FIRST_OPERAND = re.compile(r"\s*[\w\-]+\(\s*(?:([a-z][a-z0-9]*\[[^\]]*\])\S*\s+)?%?([^\s,()]+)")
_OPERANDS = re.compile(r"\(\s*%?([^\s,()]+)\s*,\s*%?([^\s,()]+)\s*\)")
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_FUSED_REDUCE_SCATTER = re.compile(r"\bcalls=%?all-reduce-scatter")  # the TPU compiler's reduce-scatter fusions
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_CALLEE_ATTR = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation"
    r"|branch_computations|called_computations)=(\{[^}]*\}|%?[^\s,{}]+)")
_CALLEE_NAME = re.compile(r"%?([^\s,{}%]+)")
_BRANCH_ATTRS = ("true_computation", "false_computation", "branch_computations")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TPU_START = re.compile(r"async-collective-start(\.\d+)?$")
_TPU_DONE = re.compile(r"async-collective-done(\.\d+)?$")
# Instructions that run a computation asynchronously: `async-start`, and `call-start` (libtpu
# 0.0.42) or `custom-call-start` (0.0.52, then `custom-call-update`s and `custom-call-done`), which
# the TPU compiler writes for a collective offloaded to the chip's SparseCores
# (async_execution_thread="sparsecore"), beside the TensorCores' compute.
ASYNC_CALLS = ("async-start", "call-start", "custom-call-start")
_TPU_STEP = re.compile(r"\bcalls=%?async_collective_fusion")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_TWO_OPERANDS = re.compile(r"\s*[\w\-]+\(\s*(?:([a-z][a-z0-9]*\[[^\]]*\])\S*\s+)?%?([^\s,()]+)\s*,"
                           r"\s*(?:([a-z][a-z0-9]*\[[^\]]*\])\S*\s+)?%?([^\s,()]+)")
_DIM_LABELS = re.compile(r"dim_labels=([^_\s,]+)_([^-\s,]+)->([^\s,]+)")


@dataclasses.dataclass
class _Computation:
    """One computation, per single execution of it."""

    own: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # kind -> [count, bytes]
    # (callee, runs per run, the share of them in the expected run: 1, or a branch's)
    calls: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)
    loops: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (body, condition), no trip count
    unknown_loops: int = 0
    constants: dict[str, int] = dataclasses.field(default_factory=dict)  # integer scalar constants by name
    shapes: dict[str, str] = dataclasses.field(default_factory=dict)  # instruction name -> its shape text
    bound: int | None = None  # as a loop condition `counter < N`: N
    # In schedule order (a compiled module is scheduled): what jaxscale.analysis.overlap reads.
    # ("start", name, key, bytes) an asynchronous collective begins; ("done", start's name);
    # ("sync", key, bytes) a collective that blocks; ("flops", n) a matmul; ("call", callee, runs).
    events: list[tuple] = dataclasses.field(default_factory=list)
    compute_only: set[str] = dataclasses.field(default_factory=set)  # callees whose collectives continue another
    wrapped: set[str] = dataclasses.field(default_factory=set)  # callees an asynchronous start runs: its "start" event
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # an async update's name -> its start's

    def add(self, kind: str, nbytes: int) -> None:
        acc = self.own.setdefault(kind, [0, 0])
        acc[0] += 1
        acc[1] += nbytes


def collective_stats(hlo_text: str) -> Stats:
    """Per-call collective counts and result bytes of a compiled HLO module.

    Returns ``{kind: {"count": int, "bytes": int}}`` for every kind in COLLECTIVES
    (zeros included), following the module docstring's counting rules. Loops with
    no known trip count count once; use `collective_stats_detail` to learn how many.
    Raises ValueError when the text has no ENTRY computation or names an
    undefined or recursive callee.
    """
    return collective_stats_detail(hlo_text)[0]


def collective_stats_detail(hlo_text: str) -> tuple[Stats, int]:
    """`collective_stats` plus the number of reachable while loops with no known trip count.

    Each such loop was counted as running once, so a non-zero second value means
    the first is a lower bound for what those loops contain.
    """
    totals = step_totals(hlo_text)
    return totals.collectives, totals.unknown_loops


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """What one call of a compiled program runs on one device, from one parse of its HLO."""

    collectives: Stats      # as `collective_stats`
    unknown_loops: int      # loops with no provable trip count (counted once)
    dot_flops: int          # as `dot_flops`
    convolutions: int       # convolutions run (the TPU compiler writes matmuls as these; not in dot_flops)
    by_groups: dict[tuple[str, str], list[int]]  # (kind, device-group spec) -> [count, bytes]

    def by_axis(self, mesh_shape: Mapping[str, int]) -> dict[str, dict[str, dict[str, float]]]:
        """{kind: {mesh axes: {"count", "bytes", "sent_bytes"}}}: the collectives by the mesh axes
        they run over ("data", "data+fsdp", ...; see `jaxscale.analysis.device_groups`), with the bytes each
        device sends for them."""
        table = {}
        for (kind, spec), (count, nbytes) in sorted(self.by_groups.items()):
            axes, size = device_groups.describe(spec, mesh_shape)
            row = table.setdefault(kind, {}).setdefault(axes, {"count": 0, "bytes": 0, "sent_bytes": 0.0})
            row["count"] += count
            row["bytes"] += nbytes
            row["sent_bytes"] += device_groups.sent_bytes(kind, nbytes, size)
        return table


def step_totals(hlo_text: str, expected: bool = False, shares: Shares = None) -> StepTotals:
    """Collectives (by kind and by device groups), unknown loops and matmul FLOPs from one parse;
    with `expected`, a conditional's branches weighted by their share (module docstring)."""
    return module_totals(*parse_module(hlo_text, shares or {}), expected)


def module_totals(computations: dict[str, _Computation], entry: str, expected: bool) -> StepTotals:
    """`step_totals` of a `parse_module` result (parse once, read both ways)."""
    memo: dict[str, dict[str, list[int]]] = {}
    totals = _totals(entry, computations, memo, set(), expected)
    # memo holds exactly the computations reachable from ENTRY.
    unknown = sum(computations[name].unknown_loops for name in memo)
    by_groups = {tuple(key.split(AT, 1)): acc for key, acc in totals.items() if AT in key}
    stats = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    for (kind, _), (count, nbytes) in by_groups.items():
        stats[kind]["count"] += count
        stats[kind]["bytes"] += nbytes
    return StepTotals(stats, unknown, totals.get("dot", [0, 0])[1], totals.get("convolution", [0, 0])[0], by_groups)


def dot_flops(hlo_text: str) -> int:
    """FLOPs of every matrix multiply one call of the program runs on one device (see the
    module docstring); loops with no provable trip count count once."""
    return step_totals(hlo_text).dot_flops


def summarize(stats: Mapping[str, Mapping[str, int]]) -> str:
    """A plain-text table of `collective_stats` output: kind, count, MiB, and a total row."""
    rows = [f"{'collective':<20}{'count':>10}{'MiB':>14}"]
    total_count = total_bytes = 0
    for kind, entry in stats.items():
        rows.append(f"{kind:<20}{entry['count']:>10}{entry['bytes'] / 2**20:>14.3f}")
        total_count += entry["count"]
        total_bytes += entry["bytes"]
    rows.append(f"{'total':<20}{total_count:>10}{total_bytes / 2**20:>14.3f}")
    return "\n".join(rows)


def parse_module(hlo_text: str, shares: Mapping[str, Sequence[float]]) -> tuple[dict[str, _Computation], str]:
    """Split the module into computations; returns them by name and the ENTRY's name."""
    computations: dict[str, _Computation] = {}
    entry: str | None = None
    current: _Computation | None = None
    for line in _logical_lines(hlo_text):
        if current is None:
            header = _header(line)
            if header is not None:
                is_entry, name = header
                current = computations[name] = _Computation()
                entry = name if is_entry else entry
        elif line.startswith("}"):
            # "}" at column 0 closes it, possibly followed by `, execution_thread="..."`.
            current = None
        else:
            _parse_instruction(line, current, computations, shares)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    for computation in computations.values():
        _resolve_loops(computation, computations)
    return computations, entry


def _logical_lines(hlo_text: str) -> Iterator[str]:
    """The module's lines, an instruction whose attributes run over several lines joined into one.
    Pallas kernels on TPU carry metadata with line breaks (`frontend_attributes={kernel_metadata=
    {` ... `}}, metadata=...`): read line by line, the `}}` would close the computation early."""
    pending = None
    for line in hlo_text.splitlines():
        text = line if pending is None else pending + " " + line
        stripped = _STRING_OR_COMMENT.sub("", text)
        pending = text if text[:1].isspace() and stripped.count("{") > stripped.count("}") else None
        if pending is None:
            yield text
    if pending is not None:
        yield pending


def _resolve_loops(computation: _Computation, computations: dict[str, _Computation]) -> None:
    """Calls for the loops with no known_trip_count: N runs where the condition reads `counter < N`."""
    for body, condition in computation.loops:
        trip = computations[condition].bound if condition in computations else None
        if trip is None:  # as if it ran once, and reported
            computation.unknown_loops += 1
            computation.calls.extend([(body, 1, 1.0), (condition, 1, 1.0)])
        else:
            computation.calls.extend([(body, trip, 1.0), (condition, trip + 1, 1.0)])


def _header(line: str) -> tuple[bool, str] | None:
    """(is_entry, name) when `line` opens a computation, else None."""
    # Headers sit at column 0 and end in "{"; module-level lines (HloModule,
    # FileNames, StackFrames...) never end in "{".
    if not line or line[0].isspace() or not line.rstrip().endswith("{") or line.startswith("HloModule"):
        return None
    match = _HEADER.match(line)
    return (bool(match.group(1)), match.group(2)) if match else None


def _parse_instruction(line: str, computation: _Computation, computations: dict[str, _Computation],
                       shares: Mapping[str, Sequence[float]]) -> None:
    """Record `line`'s collective, or the computations it calls, into `computation`."""
    code = _STRING_OR_COMMENT.sub(lambda m: '""' if m.group().startswith('"') else "", line)
    head = _INSTRUCTION.match(code)
    if head is None:
        return
    shape, rest = _split_shape(code, head.end())
    op = _OPCODE.match(rest)
    if op is None:
        return
    opcode = op.group(1)
    computation.shapes[head.group(2)] = shape
    _note_loop_bound(computation, head, opcode, rest)
    name = head.group(2)
    if opcode in ("dot", "convolution"):
        flops = (_dot_flops if opcode == "dot" else _convolution_flops)(shape, rest, computation.shapes)
        computation.add(opcode, flops)
        computation.events.append(("flops", flops))
        return
    kind = opcode.removesuffix("-start")
    if opcode == "fusion" and _FUSED_REDUCE_SCATTER.search(rest):
        key, nbytes = "reduce-scatter" + AT + _fused_groups(rest, computations), _result_bytes(opcode, shape)
        computation.add(key, nbytes)
        computation.events.append(("sync", key, nbytes))
        return
    if kind in COLLECTIVES:
        # Callees of a collective are reduction lambdas, or (for async wrappers)
        # the same collective again: following them would double count.
        nbytes = _result_bytes(opcode, shape)
        if kind == "ragged-all-to-all":
            nbytes = min(nbytes, _operand_bytes(rest, computation.shapes))
        key = kind + AT + device_groups.spec(rest)
        computation.add(key, nbytes)
        computation.events.append(("start", name, key, nbytes) if opcode.endswith("-start") else ("sync", key, nbytes))
        return
    if opcode.endswith(("-done", "-update")):
        # the matching -start already accounted for the work; an update stands for its start
        first = _FIRST_OPERAND.match(rest)
        start = computation.aliases.get(first.group(2), first.group(2)) if first else ""
        if opcode.endswith("-done"):
            computation.events.append(("done", start))
        else:
            computation.aliases[name] = start
        return
    trip = _trip_count(line) if opcode == "while" else None
    if opcode == "while" and trip is None:
        callees = dict(_CALLEE_ATTR.findall(rest))
        computation.loops.append((_CALLEE_NAME.findall(callees["body"])[0],
                                  _CALLEE_NAME.findall(callees["condition"])[0]))
        return
    callees = list(_callees(rest, trip, _scoped_shares(line, shares) if opcode == "conditional" else None))
    computation.calls.extend(callees)
    _note_async(computation, name, opcode, rest, callees, computations)


def _note_async(computation: _Computation, name: str, opcode: str, rest: str, callees: list,
                computations: dict[str, _Computation]) -> None:
    """The schedule events of an instruction that calls computations: an asynchronous wrapper
    (ASYNC_CALLS; its `async-done` or `call-done` is read as any -done), a link of the TPU compiler's
    continuation fusions (a chain that begins in `%async-collective-start.N`, steps on inside
    `async_collective_fusion` computations beside their compute and ends in
    `%async-collective-done.N`, each holding a copy of the collective, counted once, at its
    start), or a plain call."""
    ends = _TPU_DONE.match(name)
    if ends or _TPU_STEP.search(rest):
        computation.compute_only.update(callee for callee, _, _ in callees)
    if ends:
        computation.events.append(("done", name.replace("-done", "-start")))
        return
    wrapped = [key for callee, _, _ in callees for key in getattr(computations.get(callee), "own", {}) if AT in key]
    if (opcode in ASYNC_CALLS or _TPU_START.match(name)) and len(wrapped) == 1:
        computation.events.append(("start", name, wrapped[0], computations[callees[0][0]].own[wrapped[0]][1]))
        computation.wrapped.update(callee for callee, _, _ in callees)
        return
    computation.events.extend(("call", callee, runs * share) for callee, runs, share in callees)


def _fused_groups(rest: str, computations: dict[str, _Computation]) -> str:
    """The device groups of the all-reduce inside a fused reduce-scatter (HLO text defines a
    callee before its callers); "" when it cannot be found."""
    callee = computations.get(_CALLEE_NAME.findall(dict(_CALLEE_ATTR.findall(rest))["calls"])[0])
    keys = [key for key in (callee.own if callee else {}) if key.startswith("all-reduce" + AT)]
    return keys[0].split(AT, 1)[1] if keys else ""


def _dot_flops(shape: str, rest: str, shapes: dict[str, str]) -> int:
    """2 x result elements x contracted elements of a dot; 0 when its left operand's shape is unknown."""
    contracting = _CONTRACTING.search(rest)
    arrays = _ARRAY.findall(_first_operand(rest, shapes))
    if not arrays or contracting is None:
        return 0
    dims = [_dimension(d) for d in arrays[0][1].split(",") if d.strip()]
    contracted = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i)
    result = math.prod(_dimension(d) for d in _ARRAY.findall(shape)[0][1].split(",") if d.strip())
    return 2 * result * contracted


def _convolution_flops(shape: str, rest: str, shapes: dict[str, str]) -> int:
    """2 x result elements x the multiply-adds each takes: the kernel's input features times the
    window taps that land inside the (padded, strided) input; 0 when an operand's shape is unknown.
    The TPU compiler writes matmuls as convolutions, padding a window to batch over a dimension."""
    labels, operands = _DIM_LABELS.search(rest), _TWO_OPERANDS.match(rest)
    if labels is None or operands is None:
        return 0
    lhs, rhs = (_ARRAY.findall(operands.group(i) or shapes.get(operands.group(i + 1), "")) for i in (1, 3))
    out = _ARRAY.findall(shape)
    if not lhs or not rhs or not out:
        return 0
    lhs_dims, rhs_dims, out_dims = ([_dimension(d) for d in a[0][1].split(",") if d.strip()] for a in (lhs, rhs, out))
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = _window(rest)
    macs = float(rhs_dims[rhs_labels.index("i")])
    for d, size in enumerate(window["size"]):
        n, m = lhs_dims[lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))]
        taps = _taps_inside(n, m, size, window["pad"][d][0], window["stride"][d], window["rhs_dilate"][d])
        macs *= taps / m / window["lhs_dilate"][d]
    return round(2 * math.prod(out_dims) * macs)


def _window(rest: str) -> dict[str, list]:
    """A convolution's window attributes per spatial dimension: size, stride, lhs_dilate and
    rhs_dilate as ints (1 where absent), pad as (low, high) pairs ((0, 0) where absent)."""
    match = _WINDOW.search(rest)
    given = dict(item.partition("=")[::2] for item in (match.group(1).split() if match else []))
    sizes = [int(p) for p in given["size"].split("x")] if "size" in given else []
    window = {key: [int(p) for p in given[key].split("x")] if key in given else [1] * len(sizes)
              for key in ("stride", "lhs_dilate", "rhs_dilate")}
    pads = [tuple(int(v) for v in p.split("_")) for p in given["pad"].split("x")] if "pad" in given else None
    return {"size": sizes, "pad": pads or [(0, 0)] * len(sizes), **window}


def _taps_inside(n: int, m: int, k: int, low: int, stride: int, dilation: int) -> int:
    """(output position, window tap) pairs of one spatial dimension that read the input, not its padding."""
    total = 0
    for t in range(k):
        first = low - t * dilation            # o * stride must lie in [first, first + n - 1]
        lo, hi = max(0, -(-first // stride)), min(m - 1, (first + n - 1) // stride)
        total += max(0, hi - lo + 1)
    return total


def _note_loop_bound(computation: _Computation, head: re.Match, opcode: str, rest: str) -> None:
    """Remember integer constants, and N when the ROOT is `compare(x, constant N), direction=LT`."""
    if opcode == "constant":
        value = _CONSTANT.match(rest.strip())
        if value:
            computation.constants[head.group(2)] = int(value.group(1))
    elif opcode == "compare" and head.group(1) and "direction=LT" in rest:
        operands = _OPERANDS.search(rest)
        if operands and operands.group(2) in computation.constants:
            computation.bound = computation.constants[operands.group(2)]


def _split_shape(code: str, start: int) -> tuple[str, str]:
    """(result shape, text after it) for an instruction whose shape begins at `start`."""
    if code[start:start + 1] != "(":
        end = start
        while end < len(code) and not code[end].isspace():
            end += 1
        return code[start:end], code[end:]
    depth = 0
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i + 1], code[i + 1:]
    raise ValueError(f"unbalanced tuple shape in HLO line: {code.strip()[:200]}")


def _trip_count(line: str) -> int | None:
    """known_trip_count of a while instruction, or None when XLA could not prove one."""
    # Drop metadata first: an op_name string could mention known_trip_count.
    match = _TRIP_COUNT.search(_METADATA.sub("", line))
    return int(match.group(1)) if match else None


def _scoped_shares(line: str, shares: Mapping[str, Sequence[float]]) -> Sequence[float] | None:
    """The branch shares of a conditional made directly in one of `shares`' scopes (its op_name
    ends in scope/op; conditionals inside its branches are not it)."""
    op_name = _OP_NAME.search(line) if shares else None
    parts = op_name.group(1).split("/") if op_name else []
    return shares.get(parts[-2]) if len(parts) >= 2 else None


def _callees(attributes: str, trip: int | None,
             branch_shares: Sequence[float] | None = None) -> Iterator[tuple[str, int, float]]:
    """(computation, runs per run of the caller, their share in the expected run) for each callee
    named in `attributes`: a branch's share is 1/branches, or its entry in `branch_shares`."""
    found = _CALLEE_ATTR.findall(attributes)
    branches = [name for attr, value in found if attr in _BRANCH_ATTRS for name in _CALLEE_NAME.findall(value)]
    if branch_shares is not None and len(branch_shares) != len(branches):
        raise ValueError(f"{len(branch_shares)} shares given for a conditional of {len(branches)} branches")
    position = 0  # of the branch, in the conditional's order
    for attr, value in found:
        runs = 1
        if attr == "body" and trip is not None:
            runs = trip
        elif attr == "condition" and trip is not None:
            runs = trip + 1  # the condition is evaluated once more, to exit
        for name in _CALLEE_NAME.findall(value):
            share = 1.0
            if attr in _BRANCH_ATTRS:
                share = branch_shares[position] if branch_shares is not None else 1 / len(branches)
                position += 1
            yield name, runs, share


def _first_operand(rest: str, shapes: dict[str, str]) -> str:
    """The shape text of an instruction's first operand (typed inline, or an earlier
    instruction's); "" when unknown."""
    first = _FIRST_OPERAND.match(rest)
    return (first and (first.group(1) or shapes.get(first.group(2)))) or ""


def _operand_bytes(rest: str, shapes: dict[str, str]) -> int:
    """Bytes of an instruction's first operand."""
    return sum(_array_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(_first_operand(rest, shapes)))


def _result_bytes(opcode: str, shape: str) -> int:
    """Bytes of a collective's result; for -start ops, of the output part only."""
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        # all-reduce-start's shape is its result; the other -start shapes are
        # (operand(s), output(s), [context...]) and would double the bytes.
        shape = _output_part(opcode, shape)
    return sum(_array_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(shape))


def _output_part(opcode: str, shape: str) -> str:
    """The output element of a -start tuple shape: element 1, or for a flat
    all-gather-start tuple (operands..., results...) its second half."""
    parts = _tuple_elements(shape)
    if len(parts) < 2:
        return shape
    if opcode == "all-gather-start" and len(parts) > 2:
        return ", ".join(parts[len(parts) // 2:])
    return parts[1]


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape "(a, (b, c))" -> ["a", "(b, c)"]; [shape] for arrays."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, char in enumerate(shape[1:-1], start=1):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
    parts.append(shape[start:-1].strip())
    return [part for part in parts if part]


def _array_bytes(dtype: str, dims: str) -> int:
    """Bytes of one array shape such as f32[4,16]; token[] (no data) is 0."""
    if dtype == "token":
        return 0
    elements = math.prod(_dimension(d) for d in dims.split(",") if d.strip())
    return (elements * _element_bits(dtype) + 7) // 8


def _dimension(text: str) -> int:
    """One dimension; a bounded dynamic dimension "<=8" counts at its bound."""
    text = text.strip().removeprefix("<=")
    if not text.isdigit():
        raise ValueError(f"cannot size dimension {text!r}: unbounded dynamic shapes have no byte size")
    return int(text)


def _element_bits(dtype: str) -> int:
    """Bits per element: pred is a byte; other XLA types carry their width in the
    name (s8, bf16, f32, c64, c128, f8e4m3fn, s4...)."""
    if dtype == "pred":
        return 8
    match = re.match(r"[a-z]+?(\d+)", dtype)
    if match is None:
        raise ValueError(f"unknown XLA element type {dtype!r}")
    return int(match.group(1))


def computation_totals(name: str, computations: dict[str, _Computation], memo: dict, expected: bool = False
                       ) -> dict[str, list[int]]:
    """{kind: [count, bytes]} of one run of computation `name` of a `parse_module` result, callees
    included; "dot" and "convolution" carry their FLOPs as bytes. `memo` is kept between calls of
    one `expected`."""
    return _totals(name, computations, memo, set(), expected)


def _totals(name: str, computations: dict[str, _Computation], memo: dict[str, dict[str, list[int]]],
            active: set[str], expected: bool = False) -> dict[str, list[int]]:
    """{kind: [count, bytes]} for one run of computation `name`, callees included (with
    `expected`, each of n branches 1/n times).

    Memoised per computation: a callee shared by several call sites is parsed once
    but counted at every site.
    """
    if name in memo:
        return memo[name]
    if name in active:
        raise ValueError(f"computation {name!r} calls itself; HLO call graphs must be acyclic")
    if name not in computations:
        raise ValueError(f"computation {name!r} is called but not defined in the HLO text")
    active.add(name)
    total = {kind: list(acc) for kind, acc in computations[name].own.items()}
    for callee, runs, share in computations[name].calls:
        runs = runs * share if expected else runs
        continuation = callee in computations[name].compute_only  # its collective is counted at its start
        for kind, (count, nbytes) in _totals(callee, computations, memo, active, expected).items():
            if continuation and AT in kind:
                continue
            acc = total.setdefault(kind, [0, 0])
            acc[0] += runs * count
            acc[1] += runs * nbytes
    active.discard(name)
    memo[name] = total
    return total
