"""XLA flags jaxscale sets by default: on NVIDIA GPUs and on TPUs.

GPUs: each flag helps a sharded training step overlap communication with compute or batch small
collectives into large ones; MaxText and Paxml set the same family on H100 clusters. They go into
XLA_FLAGS before JAX starts its GPU backend, and the train and eval steps compile with them as
compiler options, so a plan compiled for a GPU target on any host (`python -m jaxscale.plan
--topology=h100-8`) compiles what a GPU run does. `--config.xla.gpu_defaults=False` sets none.

TPUs: the steps compile with reduce-scatters, and for a model without experts all-gathers,
offloaded to the SparseCores (v5p, v6e), which run them beside the TensorCores, and on v5e with
the TPU compiler's continuation fusions for all-gathers (CONTINUATION_FUSIONS; not for a mixture
of experts), which split a collective into steps run inside the compute fusions scheduled beside
it. libtpu supports those fusions on v5e only: from libtpu 0.0.52 a v5p, v6e or v4 program
compiled with them fails ("not supported/recommended on platforms other than TPU v5e ...
incorrect results, hang, SDC"). What each hides is read from the compiled schedule by
jaxscale.analysis.overlap (benchmarks/results/pods.md).
`--config.xla.tpu_defaults=False` sets none.

A flag already in the user's XLA_FLAGS (GPU) or LIBTPU_INIT_ARGS (TPU) is left as the user set it.
"""

from __future__ import annotations

import importlib.util
import os

GPU_FLAGS: dict[str, str] = {
    # Schedule collectives early and compute around them (overlap instead of waiting).
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Combine the many per-layer gradient all-reduces / FSDP all-gathers / reduce-scatters into
    # fewer large ones (better link utilisation, fewer launches).
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 * 2**20),
    # Start the next layer's collectives inside the scanned layer loop (pipelined collectives).
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Unroll the layer loop by two so one iteration's collectives overlap the other's compute.
    "xla_gpu_enable_while_loop_double_buffering": "true",
}


# The TPU compiler's continuation fusions for all-gathers (MaxText sets them in its v5e recipes),
# on v5e only (CONTINUATION_KINDS), the one generation libtpu supports them on. Measured on v5p
# with libtpu 0.0.42.1, which still compiled them there: Llama-3-8B on v5p-256 (fsdp=128) sent 61%
# of its 41.7 GiB beside matmuls instead of none, for 0.26 GiB more temporaries a chip. A mixture
# of experts gets little from them and pays in memory,
# the gathered experts of the layers ahead kept live: Mixtral 8x7B on v5p-256 1.59 GiB more for
# 27 ms of a 3.96 s predicted step, DeepSeek-V3 on v5p-512 17.39 GiB more (106.91 GiB a chip, past
# the 95 GiB of HBM) for 115 ms of 9.3 s; so a model with experts compiles without them
# (benchmarks/results/pods.md).
CONTINUATION_FUSIONS: dict[str, bool] = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
}
# Reduce-scatters offloaded to the chip's SparseCores, where it has them (v5p, v6e), which run
# them beside the TensorCores' compute: Llama-3-8B on v5p-256 (fsdp=128) left 9.25 GiB of its 41.7
# GiB sent exposed instead of 16.4, and 2.38 GiB of temporaries a chip instead of 2.70; Mixtral
# 8x7B's experts' gradients reduce-scattered instead of all-reduced (6.5 GiB a chip less sent).
SPARSECORE_REDUCE_SCATTER: dict[str, bool] = {"xla_tpu_enable_sparse_core_collective_offload_reduce_scatter": True}
# All-gathers offloaded too, over one, two or three torus dimensions (a v5p pod's fsdp group spans
# three; the 1-D offload alone left them blocking), for a model without experts. Llama-3-8B on
# v5p-256 with libtpu 0.0.52, fsdp=128: 25.3 of its 27.8 GiB of weight gathers sent beside
# matmuls instead of none, 4.74 GiB of the 41.7 sent exposed instead of 28.6, 2.39 GiB a chip
# instead of 2.41; fsdp=32 x tensor=4: 2.97 GiB exposed instead of 10.0, 2.25 GiB a chip instead
# of 2.40. With experts it was mixed: Mixtral 8x7B on v5p-256 exposed 50.9 GiB instead of 55.6
# for 0.08 GiB a chip less, but Qwen3-30B-A3B on v5p-128 (expert=8 x fsdp=8) left its gathers
# blocking and needed 1.45 GiB a chip more, and exposed 3.9 GiB more (benchmarks/results/pods.md).
# Generations without SparseCores (v5e, v4 here) and libtpu 0.0.42.1 accept the flags.
SPARSECORE_ALL_GATHER: dict[str, bool] = {
    "xla_tpu_enable_sparse_core_collective_offload_all_gather": True,
    "xla_tpu_enable_sparse_core_collective_offload_2d_all_gather": True,
    "xla_tpu_enable_sparse_core_collective_offload_3d_all_gather": True,
}
DENSE_OPTIONS: dict[str, bool] = {**SPARSECORE_ALL_GATHER, **SPARSECORE_REDUCE_SCATTER}
CONTINUATION_KINDS = ("TPU v5 lite",)  # device_kind of the TPUs libtpu runs continuation fusions on: v5e


def compiler_options(xla_cfg, platform: str, env=None, experts: bool = False,
                     device_kind: str = "") -> tuple[tuple[str, bool | int], ...]:
    """(name, value) pairs the steps compile with on `platform` (its devices' `device_kind`): the
    defaults above the user has not set in XLA_FLAGS (GPU) or LIBTPU_INIT_ARGS (TPU), unless the
    config turns them off; for a model with `experts` only the reduce-scatter offload, and
    continuation fusions only on a v5e."""
    env = os.environ if env is None else env
    if platform == "tpu" and xla_cfg.tpu_defaults:
        mine = _named(env.get("LIBTPU_INIT_ARGS", ""))
        if experts:
            options = SPARSECORE_REDUCE_SCATTER
        elif device_kind in CONTINUATION_KINDS:
            options = {**CONTINUATION_FUSIONS, **DENSE_OPTIONS}
        else:
            options = DENSE_OPTIONS
        return tuple((name, value) for name, value in options.items() if name not in mine)
    if platform == "gpu" and xla_cfg.gpu_defaults:
        mine = _named(env.get("XLA_FLAGS", ""))
        return tuple((name, _value(text)) for name, text in GPU_FLAGS.items() if name not in mine)
    return ()


def _value(text: str) -> bool | int:
    return text == "true" if text in ("true", "false") else int(text)


def _named(flags: str) -> set[str]:
    return {f.split("=", 1)[0].removeprefix("--") for f in flags.split() if f.startswith("--")}


def with_defaults(xla_flags: str, defaults: dict[str, str] = GPU_FLAGS) -> str:
    """`xla_flags` plus each default the user did not set."""
    mine = _named(xla_flags)
    extra = [f"--{name}={value}" for name, value in defaults.items() if name not in mine]
    return " ".join([xla_flags.strip(), *extra]).strip()


def gpu_expected(env=None) -> bool:
    """Whether JAX will start a CUDA backend: a CUDA plugin is installed and JAX_PLATFORMS allows it."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


applied: list[str] = []  # the flags this process added, for the run's notes


def apply_gpu_defaults(xla_cfg, env=None) -> list[str]:
    """Add the GPU defaults to XLA_FLAGS when a GPU backend is coming (call before JAX starts it);
    returns the flags added."""
    env = os.environ if env is None else env
    if not xla_cfg.gpu_defaults or not gpu_expected(env):
        return []
    before = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = with_defaults(before)
    applied[:] = sorted(_named(env["XLA_FLAGS"]) - _named(before))
    return list(applied)
