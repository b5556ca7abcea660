"""glibc malloc settings jaxscale makes when JAX will run on the CPU, before JAX starts its backend.

XLA:CPU takes each execution's scratch buffer (every intermediate of the train step in one
block, 50-70 MB for the benchmarks' small models) from malloc and frees it when the step ends.
glibc serves a block that large with a fresh mmap and gives it back with munmap, so each step the
kernel maps and zeroes all of its pages again: one page fault per 4 KiB, 12,600 a step on the
gpt2 benchmark shape, where they took about a quarter of the step. Kept in the heap instead --
no mmap for large blocks, no trimming of the heap's top, one arena for every thread, as
`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_ARENA_MAX=1` would at launch -- the
same pages serve every step and the faults stop (benchmarks/results/cpu_profile.md). The price: memory the
process frees stays with it, and the heap comes to hold a few scratch buffers' worth (2.6-7.4x one
buffer in the runs measured) as small blocks settle into the freed ones. So once the step is
compiled, `fit_scratch` gives large blocks back to mmap when eight buffers' worth would pass a
quarter of the memory available: a model too large for this to be cheap runs as before.

Any MALLOC_* variable or glibc.malloc tunable in the environment means the user chose: nothing
is changed. `--config.xla.cpu_defaults=False` changes nothing. Where there is no mallopt (not
glibc: macOS, Windows) nothing is changed. Called before JAX starts its CPU threads, all of
them share the one arena; called later (a notebook that used JAX before), threads that already
had their own arena keep it and only part of the faults go.
"""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

# mallopt's parameter numbers (glibc malloc.h) and the values set.
SETTINGS: dict[str, tuple[int, int]] = {
    "M_MMAP_MAX": (-4, 0),                   # never mmap a block: large ones come from the heap too
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1),     # never give the heap's free top back to the kernel
    "M_ARENA_MAX": (-8, 1),                  # one arena: the heap above serves every thread
}
GLIBC_DEFAULTS = {"M_MMAP_MAX": 65536, "M_TRIM_THRESHOLD": 128 * 1024}
SCRATCH_COPIES = 8  # what the heap may come to hold, in scratch buffers (measured: up to 7.4)
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPUs
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL2, AMD


def user_chose(env) -> bool:
    """Whether the environment already sets glibc malloc's behaviour."""
    return any(name.startswith("MALLOC_") for name in env) or "glibc.malloc" in env.get("GLIBC_TUNABLES", "")


def accelerator_present() -> bool:
    """A GPU's device file or a TPU on the PCI bus: JAX will pick it over the CPU."""
    if any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES):
        return True
    try:
        return any(Path(v).read_text().strip() == GOOGLE_PCI_VENDOR for v in glob.glob("/sys/bus/pci/devices/*/vendor"))
    except OSError:
        return False


def cpu_expected(env) -> bool:
    """Whether JAX will run on the CPU: JAX_PLATFORMS says so first, or no accelerator is there."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_present()


def _libc():
    """The C library of this process, or None where ctypes cannot open it (Windows)."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


def _mallopt():
    return getattr(_libc(), "mallopt", None)


applied: list[str] = []  # the settings this process made, for the run's notes


def apply_cpu_defaults(xla_cfg, env=None) -> list[str]:
    """Make the settings above when JAX will run on the CPU and the user set none (call before
    JAX starts its backend); returns those made."""
    env = os.environ if env is None else env
    mallopt = _mallopt()
    if not xla_cfg.cpu_defaults or mallopt is None or user_chose(env) or not cpu_expected(env):
        return []
    made = [f"{name}={value}" for name, (param, value) in SETTINGS.items() if mallopt(param, value) == 1]
    applied[:] = made
    return made


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fit_scratch(compiled) -> str | None:
    """After the step compiles: large blocks go back to mmap (glibc's defaults) and the heap's free
    pages to the system when SCRATCH_COPIES of its scratch buffers, every local device's, would
    pass a quarter of the memory available. Returns a note when they do."""
    if "M_MMAP_MAX=0" not in applied:
        return None
    import jax

    scratch_bytes = compiled.memory_analysis().temp_size_in_bytes * jax.local_device_count()
    available = _available_bytes()
    if available is None or SCRATCH_COPIES * scratch_bytes * 4 <= available:
        return None
    mallopt = _mallopt()
    for name, value in GLIBC_DEFAULTS.items():
        mallopt(SETTINGS[name][0], value)
    _libc().malloc_trim(0)  # the heap's free pages back to the system now
    applied[:] = [a for a in applied if a.split("=")[0] not in GLIBC_DEFAULTS]
    return (f"malloc gives large blocks back to the system again: {SCRATCH_COPIES} copies of the step's scratch "
            f"buffers ({scratch_bytes / 2**30:.2f} GiB each) would pass a quarter of the memory available "
            f"({available / 2**30:.1f} GiB)")
