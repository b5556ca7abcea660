"""The hardware's figures, one table: peak FLOP/s, memory sizes and bandwidths of the TPUs and GPUs
jaxscale plans for, from their datasheets. MFU (jaxscale.analysis.mfu), the compile-only targets
(topology.py, gpu_targets.py) and the step-time model's machines (machines.py) read them here.
"""

from __future__ import annotations

import dataclasses

# Dense bf16 peak TFLOP/s per device (no sparsity), matched against jax's device_kind in order.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("B200", 2250.0),
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0), ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0), ("TPU7x", 2307.0),
)


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU chip's memory and links; bandwidths in bytes/s."""

    hbm_gib: int            # HBM per chip
    hbm_bandwidth: float
    ici_bandwidth: float    # bidirectional
    dcn_bandwidth: float    # the data-center network's share of a chip


# From Cloud TPU's system-architecture pages: v5p 95 GiB, 2765 GBps HBM, 1200 GBps ICI, 50 Gbps
# DCN; v5e 16 GiB, 819 GBps, 400 GBps and 2 x 100 Gbps NICs a host of 8 chips; v6e 32 GiB, 1638
# GBps, 800 GBps (its DCN is not published: v5e's is assumed); v4 32 GiB, 1200 GBps HBM, and as
# ICI its 1.1 PB/s all-reduce bandwidth per 4096-chip pod doubled (the ratio v5e's and v6e's
# pages show), its DCN assumed to be v5e's.
TPUS = {"v4": TpuChip(32, 1200e9, 537e9, 25e9 / 8), "v5p": TpuChip(95, 2765e9, 1200e9, 50e9 / 8),
        "v5e": TpuChip(16, 819e9, 400e9, 25e9 / 8), "v6e": TpuChip(32, 1638e9, 800e9, 25e9 / 8)}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as its CUDA driver reports it."""

    name: str               # the device name the driver reports (JAX's device_kind)
    memory_bytes: int       # device memory the driver reports
    memory_bandwidth: int   # bytes/s
    compute_capability: tuple[int, int] = (9, 0)
    sms: int = 132
    l2_cache_bytes: int = 52_428_800
    clock_rate_ghz: float = 1.98


# The SXM H100, 80 GB HBM3, and the H200, 141 GB HBM3e.
GPUS = {"h100": Gpu("NVIDIA H100 80GB HBM3", 84_942_979_072, 3_352_320_000_000),
        "h200": Gpu("NVIDIA H200 141GB HBM3e", 151_397_597_184, 4_800_000_000_000)}
GPUS_PER_HOST = 8
NVLINK = 900e9           # bytes/s, bidirectional, per H100/H200 SXM GPU (NVLink 4: 18 links x 50 GB/s)
NETWORK_PER_GPU = 50e9   # bytes/s, one direction: one 400 Gb/s InfiniBand NIC per GPU (DGX H100/H200)
