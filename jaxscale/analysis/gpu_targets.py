"""NVIDIA GPUs described for XLA's GPU compiler, so a train step compiles for them on a host with
no GPU (the CUDA PJRT plugin's compile-only path: `jax.experimental.topologies` with a target
config, as the TPU compile-only client needs no TPU).

A target config is a `stream_executor.GpuTargetConfigProto` in text form: the properties the
compiler reads (compute capability, SMs, shared memory, L2, memory size and bandwidth) instead
of querying a device. The values below are the public specifications of each part (the SXM
H100, 80 GB HBM3, and the H200, 141 GB HBM3e), as its CUDA driver reports them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str               # the device name the driver reports (JAX's device_kind)
    memory_bytes: int       # device memory the driver reports
    memory_bandwidth: int   # bytes/s
    compute_capability: tuple[int, int] = (9, 0)
    sms: int = 132

    def target_config(self) -> str:
        """The GpuTargetConfigProto text the CUDA plugin compiles against."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {self.sms} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {self.memory_bytes} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.name}"
"""


GPUS = {"h100": Gpu("NVIDIA H100 80GB HBM3", 84_942_979_072, 3_352_320_000_000),
        "h200": Gpu("NVIDIA H200 141GB HBM3e", 151_397_597_184, 4_800_000_000_000)}
GPUS_PER_HOST = 8
NVLINK = 900e9           # bytes/s, bidirectional, per H100/H200 SXM GPU (NVLink 4: 18 links x 50 GB/s)
NETWORK_PER_GPU = 50e9   # bytes/s, one direction: one 400 Gb/s InfiniBand NIC per GPU (DGX H100/H200)
