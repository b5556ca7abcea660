"""Pre-flight checks of a multi-process job, before its model compiles (`distributed.preflight`).

1. Every device computes a known product and checks the answer (a bad device is named).
2. The checkpoint directory is written and read back by every process.
3. The processes exchange those results in one collective over all of them: a process that does
   not answer holds the job here, where the runtime's heartbeat ends it, not mid-compile.
4. One all-reduce per mesh axis checks the sum and measures the axis's bus bandwidth.
Any failure ends every process with PreflightError, one line naming the process and what failed
(exit code 3), before anything large compiles. `JAXSCALE_PREFLIGHT_INJECT=wrong_answer@P` makes
process P's first device answer wrong: a testing aid, as fault injection in the field's tools.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.errors import PreflightError
from jaxscale.runtime.exchange import allgather_json

INJECT = "JAXSCALE_PREFLIGHT_INJECT"
PROBE_BYTES = 4 * 2**20  # the all-reduce timed on each mesh axis


def _device_faults() -> list[str]:
    """This process's devices whose answer to a known product is wrong."""
    x = (np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 17) / 16
    want, faults = x @ x.T, []
    inject = os.environ.get(INJECT, "") == f"wrong_answer@{jax.process_index()}"
    for i, device in enumerate(jax.local_devices()):
        got = np.asarray(jnp.matmul(jax.device_put(x, device), jax.device_put(x.T, device)))
        error = float(np.max(np.abs(got + (1.0 if inject and i == 0 else 0.0) - want)))
        if not error <= 1e-3:
            faults.append(f"its device {i} (id {device.id}) computed a wrong answer (off by {error:.3g})")
    return faults


def _directory_fault(directory: Path) -> list[str]:
    """The checkpoint directory written and read back (each process its own file)."""
    probe, payload = directory / f".preflight-{jax.process_index()}-{os.getpid()}", os.urandom(64)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(payload)
        ok = probe.read_bytes() == payload
        probe.unlink()
    except OSError as error:
        return [f"cannot write and read back {directory} ({error.strerror or error})"]
    return [] if ok else [f"{directory} returned other bytes than were written"]


def _axis_bandwidth(mesh, axis: str) -> tuple[bool, float]:
    """(the all-reduce over `axis` summed right, its bus bandwidth in GB/s)."""
    n, size = mesh.shape[axis], PROBE_BYTES // 4
    sharding = NamedSharding(mesh, P(axis))
    ones = jax.make_array_from_callback((n * size,), sharding, lambda index: np.ones(size, np.float32))
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis), mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    jax.block_until_ready(reduce(ones))
    start = time.perf_counter()
    out = jax.block_until_ready(reduce(ones))
    seconds = time.perf_counter() - start
    ok = all(np.all(np.asarray(shard.data) == n) for shard in out.addressable_shards)
    return ok, 2 * (n - 1) / n * PROBE_BYTES / seconds / 1e9


def check(mesh, checkpoint_dir: Path, say) -> None:
    """Run the checks; PreflightError on every process if any process failed one."""
    found = dict(enumerate(allgather_json(_device_faults() + _directory_fault(Path(checkpoint_dir)))))
    failed = {i: faults for i, faults in found.items() if faults}
    if failed:
        detail = "; ".join(f"process {i}: {', '.join(faults)}" for i, faults in sorted(failed.items()))
        raise PreflightError(f"preflight failed before compiling: {detail} (distributed.preflight=False skips "
                             "these checks)")
    rates = []
    for axis in (a for a in mesh.axis_names if mesh.shape[a] > 1):
        ok, rate = _axis_bandwidth(mesh, axis)
        if not ok:
            raise PreflightError(f"preflight failed before compiling: the all-reduce over mesh axis {axis} "
                                 "summed wrong on some process")
        rates.append(f"{axis}={mesh.shape[axis]} {rate:.2f} GB/s")
    say(f"preflight: {jax.process_count()} processes, {jax.device_count()} devices answered; checkpoint directory "
        f"writable; all-reduce bus bandwidth {', '.join(rates) or 'n/a (one device)'}")
