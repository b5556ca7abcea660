"""The machines the step-time model (jaxscale.analysis.cost) predicts for: TPU pods and GPU hosts
from their datasheets, and this host's CPU from a short measurement.

The efficiency of the matmuls is calibrated where this project has measured a step: llama_1b on
one H200 (batch 8, seq 2048, dots_saveable remat) ran 291 ms a step; the matmuls its compiled
program is expected to run (138.5 TFLOP, each conditional's branches by their share) and its
memory term (19 ms) at the H200's peak put them at 51.5% of it (GPU_EFFICIENCY).
gpt2_124m (batch 16, seq 2048), measured at 108 ms, is predicted at 74 ms with it: its smaller
matmuls reach less of the peak (benchmarks/results/search.md). No TPU step has been measured
here: TPUs are given the same efficiency, an assumption the table marks.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.analysis import hardware, topology
from jaxscale.analysis.cost import Machine
from jaxscale.analysis.mfu import peak_tflops

GPU_EFFICIENCY = 0.515     # llama_1b on one H200, 291 ms a step (benchmarks/search.py --calibrate)
GPU_LATENCY_S = 20e-6      # NCCL's fixed cost a collective (assumed)
TPU_LATENCY_S = 5e-6       # ICI's (assumed)
HIDING = "collectives hidden by the matmuls their schedule runs beside them (estimates: data/fsdp/pipeline)"


def for_pod(pod: topology.Pod, devices: list) -> Machine:
    """A TPU slice or GPU hosts, per device (v4's compile-only client makes a device per TensorCore)."""
    per_chip = pod.chips * pod.slices / len(devices)
    memory = topology.hbm_per_device(pod, devices)
    peak = peak_tflops(devices[0].device_kind) * 1e12 * per_chip
    if pod.platform == "gpu":
        gpu = hardware.GPUS[pod.generation]
        return Machine(pod.name, peak, GPU_EFFICIENCY, memory, gpu.memory_bandwidth, hardware.NVLINK / 2,
                       hardware.NETWORK_PER_GPU, hardware.GPUS_PER_HOST, GPU_LATENCY_S,
                       assumptions=(f"matmuls at {GPU_EFFICIENCY:.1%} of peak (calibrated on llama_1b, one H200)",
                                    f"{GPU_LATENCY_S * 1e6:.0f} us a collective",
                                    HIDING))
    chip = hardware.TPUS[pod.generation]
    return Machine(pod.name, peak, GPU_EFFICIENCY, memory, chip.hbm_bandwidth * per_chip,
                   chip.ici_bandwidth / 2 * per_chip, chip.dcn_bandwidth * per_chip, len(devices) // pod.slices,
                   TPU_LATENCY_S,
                   assumptions=(f"matmuls at {GPU_EFFICIENCY:.1%} of peak (the H200's, no TPU step measured)",
                                "a collective gets the chip's whole ICI bandwidth one way",
                                f"{TPU_LATENCY_S * 1e6:.0f} us a collective",
                                HIDING))


@functools.partial(jax.jit, static_argnums=1)
def _chain(x, iterations: int):
    return jax.lax.fori_loop(0, iterations, lambda _, y: (y @ x) * (1.0 / x.shape[0]), x)


def _best_s(fn, repeats: int = 7) -> float:
    """The fastest of `repeats` timed calls after a warm-up: what the host can do (a shared
    machine's noise only slows a call)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def _allreduce_chain(mesh, times: int):
    """A program of `times` all-reduces of one number over every device of `mesh`, one after another."""
    from jax.sharding import NamedSharding, PartitionSpec

    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec("all")))
    def chain(x):
        for _ in range(times):
            x = jnp.broadcast_to(x.sum(0) * 0.5, x.shape)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("all")))
        return x
    return chain


def calibrate_cpu(devices: list) -> Machine:
    """This host's virtual CPU devices, measured: the matmul rate of all of them at once, a copy's
    bandwidth, an all-reduce's cost inside a program (a chain of 17 less a chain of 1, over every
    device: the rendezvous of their threads), and its bandwidth (the collective runs through the
    same memory whichever axes it spans)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n, size, iterations = len(devices), 256, 8
    mats = [jax.device_put(jnp.full((size, size), 1.0, jnp.float32), d) for d in devices]
    matmul_s = _best_s(lambda: [_chain(m, iterations) for m in mats])
    rate = n * iterations * 2 * size**3 / matmul_s
    big = [jax.device_put(np.ones(2**22, np.float32), d) for d in devices]  # 16 MiB each
    copy_s = _best_s(lambda: [x * 1.0001 for x in big])
    memory_bandwidth = n * 2 * big[0].nbytes / copy_s
    mesh = Mesh(np.array(devices), ("all",))
    summed = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))

    def allreduce_s(elements: int) -> float:
        x = jax.device_put(np.ones((n, elements), np.float32), NamedSharding(mesh, PartitionSpec("all")))
        return _best_s(lambda: summed(x))

    small, large = allreduce_s(1), allreduce_s(2**20)
    sent = 2 * (n - 1) / n * 4 * 2**20  # ring arithmetic: bytes each device sends for a 4 MiB all-reduce
    bandwidth = sent / max(large - small, 1e-9)
    x = jax.device_put(np.ones((n, 1), np.float32), NamedSharding(mesh, PartitionSpec("all")))
    one, chained = _allreduce_chain(mesh, 1), _allreduce_chain(mesh, 17)
    latency = max(_best_s(lambda: chained(x)) - _best_s(lambda: one(x)), 0.0) / 16
    return Machine(f"cpu x{n}", rate, 1.0, float("inf"), memory_bandwidth, bandwidth, bandwidth, n, latency,
                   shared_cores=True,
                   assumptions=(f"measured here: matmuls {rate / 1e9:.1f} GFLOP/s, memory {memory_bandwidth / 1e9:.1f} "
                                f"GB/s, an all-reduce in a program {latency * 1e6:.0f} us + {bandwidth / 1e9:.2f} GB/s "
                                "a device",
                                "virtual devices share the host's cores: their work adds up, nothing overlaps, a "
                                "pipeline's idle ticks cost nothing"))
