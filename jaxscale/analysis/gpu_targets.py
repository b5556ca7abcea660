"""NVIDIA GPUs described for XLA's GPU compiler, so a train step compiles for them on a host with
no GPU (the CUDA PJRT plugin's compile-only path: `jax.experimental.topologies` with a target
config, as the TPU compile-only client needs no TPU).

A target config is a `stream_executor.GpuTargetConfigProto` in text form: the properties the
compiler reads (compute capability, SMs, shared memory, L2, memory size and bandwidth) instead
of querying a device. Each part's figures are its public specifications, as its CUDA driver
reports them (jaxscale.analysis.hardware.GPUS); the rest are CUDA's limits on Hopper.
"""

from __future__ import annotations

from jaxscale.analysis.hardware import Gpu


def target_config(gpu: Gpu) -> str:
    """The GpuTargetConfigProto text the CUDA plugin compiles against."""
    major, minor = gpu.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {gpu.sms} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {gpu.memory_bandwidth} l2_cache_size: {gpu.l2_cache_bytes} clock_rate_ghz: {gpu.clock_rate_ghz}
  device_memory_size: {gpu.memory_bytes} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{gpu.name}"
"""
