"""Where a GPU step's time goes: the kernels of a jax.profiler trace, by class.

Each kernel event on the GPU's stream lines is classed by its name and, where the trace names
the HLO instruction it runs (the `hlo_op` stat), by that instruction in the compiled program:
GEMMs by the dtype they multiply in (float32/TF32, bfloat16, fp8), cuDNN attention forward and
backward, copies, the optimizer's update, reductions, other fusions. `benchmarks/gpu.py
--profile` prints the table; on a CPU the trace holds no GPU kernels and the table says so.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

CLASSES = ("GEMM fp32/tf32", "GEMM bf16", "GEMM fp8", "GEMM other", "attention forward", "attention backward",
           "copies", "optimizer", "reductions", "other fusions", "other")
_GEMM = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma")
_OPTIMIZER = ("opt_state", "adam", "apply_updates", "clip_by_global_norm")


def _gemm_dtype(text: str) -> str:
    if re.search(r"e4m3|e5m2|f8", text):
        return "GEMM fp8"
    if "bf16" in text:
        return "GEMM bf16"
    if re.search(r"tf32|f32", text):
        return "GEMM fp32/tf32"
    return "GEMM other"


def kernel_class(name: str, hlo_line: str = "") -> str:
    """The class of a kernel named `name` running HLO instruction `hlo_line` (its text, or "")."""
    low, op = name.lower(), hlo_line.lower()
    if any(mark in low for mark in ("cudnn", "sdpa", "flash_fprop", "flash_bprop")):
        return "attention backward" if re.search(r"bprop|bwd|dgrad|backward", low) else "attention forward"
    if any(mark in low for mark in _GEMM) or "gemm_fusion" in op or "__cublas" in op:
        return _gemm_dtype(op or low)
    if "memcpy" in low or "memset" in low or re.match(r"\s*%?(copy|transpose)", op):
        return "copies"
    if any(mark in op for mark in _OPTIMIZER):
        return "optimizer"
    if "reduce" in low or "reduce" in op:
        return "reductions"
    return "other fusions" if "fusion" in low or "fusion" in op else "other"


def _hlo_lines(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its line, with the header of the computation it calls (which
    names its operands' types: what a GEMM fusion multiplies)."""
    headers = {m.group(1): m.group(0) for m in re.finditer(r"^%?([\w.\-]+) \([^\n]*\) -> [^\n]*\{$", hlo_text, re.M)}
    lines = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if match:
            called = re.search(r"calls=%?([\w.\-]+)", line)
            lines[match.group(1)] = line + (" " + headers.get(called.group(1), "") if called else "")
    return lines


def kernel_times(trace_dir: Path, hlo_text: str = "") -> collections.Counter:
    """Nanoseconds per class over the GPU kernels of every trace file under trace_dir."""
    from jax._src.lib import _profile_data

    lines, times = _hlo_lines(hlo_text), collections.Counter()
    for path in Path(trace_dir).rglob("*.xplane.pb"):
        for plane in _profile_data.ProfileData.from_file(str(path)).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                for event in line.events:
                    op = dict(event.stats).get("hlo_op", "")
                    times[kernel_class(event.name, lines.get(str(op), ""))] += event.duration_ns
    return times


def table(per_step_ms: dict[str, float]) -> str:
    """Milliseconds per step by class, largest first."""
    if not per_step_ms:
        return "no GPU kernels in the trace"
    total = sum(per_step_ms.values())
    rows = [f"| {name} | {ms:,.2f} | {100 * ms / total:.1f}% |"
            for name, ms in sorted(per_step_ms.items(), key=lambda item: -item[1])]
    return "\n".join(["| kernels | ms a step | share |", "|---|---|---|", *rows, f"| total | {total:,.2f} | |"])
