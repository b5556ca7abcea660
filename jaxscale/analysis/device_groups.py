"""Which mesh axes a compiled collective runs over, and how many bytes each device sends for it.

A collective in post-optimisation HLO names its device groups in one of four forms (ids are
positions in the program's device assignment, which for a jitted step is the mesh's devices in
row-major order, so id i sits at `numpy.unravel_index(i, mesh shape)`):

    replica_groups={{0,1},{2,3}}                                explicit groups
    replica_groups=[4,2]<=[2,2,2]T(2,1,0)                       iota: 4 groups of 2
    replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}
                                                                over named axes of a device array
    source_target_pairs={{0,1},{1,0}}                           collective-permute

`describe(text, mesh_shape)` names the mesh axes along which a group's members differ. Bytes sent
per device, from the result bytes R and the group size n (ring algorithms, as nccl-tests count):
all-reduce 2(n-1)/n R, all-gather and all-to-all (n-1)/n R, reduce-scatter (n-1) R (its result
is 1/n of what is reduced), collective-permute R when the device sends to another.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

UNKNOWN = "?"   # a group form this module does not read
NONE = "none"   # every device keeps to itself (size-1 groups, or a permute onto itself)

_EXPLICIT = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\})")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                   r"\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=(\{(?:\{\d+,\d+\},?\s*)*\})")
_NAMED = re.compile(r"'([^']+)'=(\d+)")


def spec(line: str) -> str:
    """The device-group part of a collective's HLO line ("" when it names none: all devices)."""
    for pattern in (_MESH, _IOTA, _EXPLICIT, _PAIRS):
        match = pattern.search(line)
        if match:
            return match.group(0)
    return ""


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _rows(text: str) -> list[list[int]]:
    return [[int(x) for x in row.split(",") if x.strip()] for row in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def _mesh_groups(match: re.Match, devices: int) -> list[list[int]]:
    named = [(name, int(size)) for name, size in _NAMED.findall(match.group(1))]
    shape = [size for _, size in named]
    ids = _iota(match.group(2), match.group(3)) if match.group(2) else np.arange(devices)
    ids = ids.reshape(shape)
    over = [name.strip().strip("'") for name in match.group(4).split(",") if name.strip()]
    if any(name not in dict(named) for name in over):
        raise ValueError(f"unreadable axes {match.group(4)!r}")
    inner = [i for i, (name, _) in enumerate(named) if name in over]
    outer = [i for i in range(len(named)) if i not in inner]
    return ids.transpose(outer + inner).reshape(-1, int(np.prod([shape[i] for i in inner]))).tolist()


def groups(text: str, devices: int) -> list[list[int]]:
    """The device groups `text` (from `spec`) names; pairs for a collective-permute. Raises
    ValueError for a form this module does not read."""
    if not text:
        return [list(range(devices))]
    if (match := _MESH.fullmatch(text)) is not None:
        return _mesh_groups(match, devices)
    if (match := _IOTA.fullmatch(text)) is not None:
        size = [int(d) for d in match.group(1).split(",")]
        return _iota(match.group(2), match.group(3)).reshape(size).tolist()
    if (match := _EXPLICIT.fullmatch(text) or _PAIRS.fullmatch(text)) is not None:
        rows = _rows(match.group(1))
        return rows if rows else [list(range(devices))]
    raise ValueError(f"unreadable device groups {text!r}")


def describe(text: str, mesh_shape: Mapping[str, int]) -> tuple[str, int]:
    """(the mesh axes the collective runs over, joined by "+" in mesh order, or NONE or UNKNOWN;
    devices per group: 2 for a permute that moves data, 1 when nothing leaves a device)."""
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    try:
        found = groups(text, int(np.prod(shape)))
    except ValueError:
        return UNKNOWN, int(np.prod(shape))
    varying = set()
    for group in found:
        coords = np.array(np.unravel_index(np.array(group), shape)).T
        varying.update(i for i in range(len(names)) if len(set(coords[:, i])) > 1)
    if text.startswith("source_target_pairs"):
        size = 2 if any(a != b for a, b in found) else 1
    else:
        size = max(len(g) for g in found)
    return "+".join(names[i] for i in sorted(varying)) or NONE, size


def sent_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Bytes one device sends for a collective with `result_bytes` of result in groups of `n`."""
    if n <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
              "ragged-all-to-all": (n - 1) / n,  # of its bytes bound (profile): even routing
              "reduce-scatter": n - 1, "collective-permute": 1.0}[kind]
    return factor * result_bytes
