"""TPU pod slices by their Cloud TPU names, and NVIDIA GPU hosts, as devices to compile for on
any host.

    devices, pod = topology.compile_only_devices("v5p-256")   # 128 chips, nothing allocated
    devices, pod = topology.compile_only_devices("h100-16")   # two hosts of 8 H100s

JAX's TPU compile-only client (libtpu, `pip install 'jaxscale[tpu]'`) describes a topology's
devices without owning them, so the real train step compiles for a pod on a laptop, and its
memory and collectives come from the TPU compiler. Names follow Cloud TPU: `v4-N` and `v5p-N`
count TensorCores (2 per chip), `v5e-N` and `v6e-N` chips; `KxNAME` is K slices joined over the
data-center network (mesh_dcn). GPUs (`h100-N`, `h200-N`: N GPUs, 8 a host) come from JAX's
CUDA plugin compiling against a described target (`jaxscale.analysis.gpu_targets`; `pip install
'jaxscale[gpu-plan]'`), which needs no GPU either.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jaxscale.analysis.gpu_targets import target_config
from jaxscale.analysis.hardware import GPUS, GPUS_PER_HOST, TPUS
from jaxscale.errors import ConfigError

GIB = 2**30
# generation -> (libtpu's name, TensorCores counted per chip in the slice name, 3D torus); their
# memory and links: jaxscale.analysis.hardware.TPUS
GENERATIONS = {"v4": ("v4", 2, True), "v5p": ("v5p", 2, True), "v5e": ("v5e", 1, False), "v6e": ("v6e", 1, False)}
# chips -> the slice's shape in chips: 2D for v5e/v6e, 3D tori for v4/v5p
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_NAME = re.compile(r"(?:(\d+)x)?(v4|v5p|v5e|v6e)-(\d+)")
_GPU_NAME = re.compile(r"(h100|h200)-(\d+)")
FIELD = "--topology"


@dataclasses.dataclass(frozen=True)
class Pod:
    """A named TPU pod: `slices` slices of `chips` chips each, in `shape`; or GPUs (`platform`
    "gpu"): `chips` GPUs in one slice, `shape` as the CUDA plugin names it ("1xHOSTSxGPUS")."""

    name: str
    generation: str
    chips: int             # per slice
    slices: int
    shape: str             # per slice, as libtpu names it: "4x4x8"
    hbm_per_chip: int      # bytes
    platform: str = "tpu"

    @property
    def libtpu_name(self) -> str:
        return f"{GENERATIONS[self.generation][0]}:{self.shape}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which of the slice's dimensions close into rings by wraparound links: every dimension of
        a v4/v5p slice built of whole 4x4x4 cubes (a torus), and a 16-chip dimension of a v5e/v6e
        slice. Described without them, a 128-chip axis is no ring and the TPU compiler writes its
        all-gathers as all-reduces of zero-filled buffers (twice the bytes)."""
        dims = [int(d) for d in self.shape.split("x")]
        if GENERATIONS[self.generation][2]:
            return (all(d % 4 == 0 for d in dims),) * 3
        return (dims[0] == 16, dims[1] == 16, False)

    @property
    def chip_config(self) -> str:
        """libtpu's name for how a chip's TensorCores make devices: one megacore on v4 and v5p."""
        return "megacore" if GENERATIONS[self.generation][2] else "default"

    @property
    def accelerator_type(self) -> str:
        """One slice's Cloud TPU accelerator type (v5e's is spelled v5litepod)."""
        count = self.chips * GENERATIONS[self.generation][1]
        return f"{'v5litepod' if self.generation == 'v5e' else self.generation}-{count}"


def parse(name: str) -> Pod:
    """The pod a Cloud TPU slice name (or h100-N, h200-N) describes; ConfigError naming
    --topology otherwise."""
    gpus = _GPU_NAME.fullmatch(name.strip().lower())
    if gpus:
        return _gpu_pod(name, gpus.group(1), int(gpus.group(2)))
    match = _NAME.fullmatch(name.strip().lower())
    if not match:
        raise ConfigError(FIELD, name, "expected a Cloud TPU slice such as v5p-256, v5e-256, v6e-256, v4-128 "
                                       "or 2xv5e-256 (two slices), or GPUs such as h100-8 or h200-16")
    slices, generation, count = int(match.group(1) or 1), match.group(2), int(match.group(3))
    _, cores_per_chip, torus = GENERATIONS[generation]
    shapes = SHAPES_3D if torus else SHAPES_2D
    chips = count // cores_per_chip
    if count % cores_per_chip or chips not in shapes or slices < 1:
        sizes = ", ".join(f"{generation}-{c * cores_per_chip}" for c in shapes)
        raise ConfigError(FIELD, name, f"no such {generation} slice; known: {sizes}")
    return Pod(name, generation, chips, slices, shapes[chips], TPUS[generation].hbm_gib * GIB)


def _gpu_pod(name: str, generation: str, count: int) -> Pod:
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ConfigError(FIELD, name, f"{generation}-N counts GPUs, {GPUS_PER_HOST} a host: use up to "
                                       f"{GPUS_PER_HOST}, or a multiple of {GPUS_PER_HOST}")
    hosts, per_host = max(1, count // GPUS_PER_HOST), min(count, GPUS_PER_HOST)
    return Pod(name, generation, count, 1, f"1x{hosts}x{per_host}", GPUS[generation].memory_bytes, "gpu")


def _gpu_devices(pod: Pod) -> list:
    try:
        from jax.experimental import topologies

        target = target_config(GPUS[pod.generation])
        return list(topologies.get_topology_desc(pod.generation, "cuda", target_config=target,
                                                 topology=pod.shape).devices)
    except (ImportError, RuntimeError, NotImplementedError) as error:
        raise ConfigError(FIELD, pod.name, "compiling for GPUs on this host needs JAX's CUDA plugin: "
                                           "pip install 'jaxscale[gpu-plan]' "
                                           f"({str(error).splitlines()[0][:120]})") from None


def compile_only_devices(name: str) -> tuple[list, Pod]:
    """(devices to compile for, the pod) of a named slice; nothing is allocated. Needs libtpu
    (TPUs) or JAX's CUDA plugin (GPUs)."""
    pod = parse(name)
    if pod.platform == "gpu":
        return _gpu_devices(pod), pod
    # libtpu reads these when it starts; off a TPU VM it would guess them and print warnings.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", pod.accelerator_type)
    # A compile-only client owns no chip, so it takes no lock on the host's TPUs: without this a
    # second plan running beside the first died on libtpu's multi-process lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        kwargs = {"num_slices": pod.slices} if pod.slices > 1 else {}
        devices = topologies.get_topology_desc(pod.libtpu_name, "tpu", chip_config_name=pod.chip_config,
                                               wrap=pod.wrap, **kwargs).devices
    except (ImportError, RuntimeError) as error:
        raise ConfigError(FIELD, name, "compiling for a TPU topology needs libtpu: pip install 'jaxscale[tpu]' "
                                       f"({str(error).splitlines()[0][:120]})") from None
    return list(devices), pod


def hbm_per_device(pod: Pod, devices: list) -> float:
    """HBM bytes one device may use: a chip's HBM, shared by the devices libtpu makes of a chip
    (one per chip on v5p, v5e and v6e; v4's compile-only client makes one per TensorCore)."""
    return pod.hbm_per_chip * pod.chips * pod.slices / len(devices)
