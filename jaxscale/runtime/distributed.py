"""Joining a multi-process job: JAX's multi-controller runtime (`jax.distributed`), set up from
the config or from what the scheduler put in the environment.

Where the process count, this process's index and the coordinator come from, first match wins:
  config     distributed.coordinator_address, num_processes, process_id
  launcher   JAXSCALE_COORDINATOR, JAXSCALE_NUM_PROCESSES, JAXSCALE_PROCESS_ID (python -m jaxscale.launch,
             and the Kubernetes template, which sets them for every pod)
  kubernetes an indexed Job or JobSet pod: its index from JOB_COMPLETION_INDEX, the rest as above
  slurm      srun tasks (SLURM_NTASKS > 1): JAX's own SLURM detection
  openmpi    mpirun ranks (OMPI_COMM_WORLD_SIZE > 1): JAX's own Open MPI detection
  tpu        a multi-host TPU slice (TPU_WORKER_HOSTNAMES lists several hosts): JAX's own detection
Nothing found: one process, and jax.distributed is not started.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import NoReturn

import jax
import numpy as np

from jaxscale.errors import ConfigError, require_positive

LAUNCH_ENV = ("JAXSCALE_COORDINATOR", "JAXSCALE_NUM_PROCESSES", "JAXSCALE_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Cluster:
    source: str                      # where the settings came from (see the module docstring)
    num_processes: int | None        # None: JAX's detection finds it
    process_id: int | None
    coordinator: str | None = None
    method: str | None = None        # JAX's cluster_detection_method, when JAX detects the rest
    local_device_ids: tuple[int, ...] | None = None  # the GPUs this process drives (None: JAX decides)


def check(config) -> None:
    """The `distributed` timeouts are usable; raises ConfigError naming the field."""
    require_positive(config, ("distributed.initialization_timeout_s", "distributed.heartbeat_timeout_s"))


def _int(env, name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


def _from_config(d) -> Cluster | None:
    if not d.coordinator_address:
        return None
    if d.num_processes < 1 or d.process_id < 0:
        raise ConfigError("distributed.coordinator_address", d.coordinator_address,
                          "also set distributed.num_processes and distributed.process_id (this process's index)")
    return Cluster("config", d.num_processes, d.process_id, d.coordinator_address)


def _from_env(env, d) -> Cluster | None:
    """Our launcher's variables, or a Kubernetes indexed Job's index with the other two."""
    index = _int(env, "JAXSCALE_PROCESS_ID")
    source = "jaxscale.launch"
    if index is None and _int(env, "JOB_COMPLETION_INDEX") is not None:
        index, source = _int(env, "JOB_COMPLETION_INDEX"), "kubernetes"
    if index is None:
        return None
    count = _int(env, "JAXSCALE_NUM_PROCESSES") or d.num_processes
    coordinator = env.get("JAXSCALE_COORDINATOR", "")
    if count < 1 or not coordinator:
        raise ConfigError("JAXSCALE_NUM_PROCESSES" if count < 1 else "JAXSCALE_COORDINATOR", "",
                          f"process index {index} came from {source}; also set JAXSCALE_NUM_PROCESSES and "
                          "JAXSCALE_COORDINATOR=host:port (process 0's address), as configs/cluster/ shows")
    return Cluster(source, count, index, coordinator)


def _visible_gpus(env) -> tuple[int, ...] | None:
    """Every GPU the scheduler lets this task see. JAX's SLURM and MPI detection would otherwise
    give each process only the GPU numbered by its local rank: one task per node drives one GPU,
    and one task per GPU asks for a device its CUDA_VISIBLE_DEVICES hides."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return tuple(range(len(visible))) if visible else None


def _from_scheduler(env) -> Cluster | None:
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")):
        if (_int(env, "SLURM_NTASKS") or 1) > 1:
            return Cluster("slurm", _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"), method="slurm",
                           local_device_ids=_visible_gpus(env))
    if "OMPI_MCA_orte_hnp_uri" in env and (_int(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return Cluster("openmpi", _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"), method="ompi",
                       local_device_ids=_visible_gpus(env))
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return Cluster("tpu", None, _int(env, "TPU_WORKER_ID"))
    return None


def detect(dist_cfg, env=None) -> Cluster | None:
    """The multi-process job this process belongs to, or None for a single process."""
    env = os.environ if env is None else env
    cluster = _from_config(dist_cfg) or _from_env(env, dist_cfg) or _from_scheduler(env)
    if cluster is not None and cluster.num_processes == 1:
        return None
    if cluster is not None and cluster.process_id is not None and cluster.num_processes is not None \
            and not 0 <= cluster.process_id < cluster.num_processes:
        raise ConfigError("process index", cluster.process_id,
                          f"{cluster.source} says {cluster.num_processes} processes; the index must be below that")
    return cluster


def initialize(dist_cfg, env=None) -> Cluster | None:
    """Start jax.distributed when this process is part of a job (before anything touches the
    devices); returns what was joined, or None for a single process."""
    cluster = detect(dist_cfg, env)
    if cluster is None or jax.distributed.is_initialized():
        return cluster
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
        process_id=cluster.process_id, cluster_detection_method=cluster.method,
        local_device_ids=None if cluster.local_device_ids is None else list(cluster.local_device_ids),
        initialization_timeout=int(dist_cfg.initialization_timeout_s),
        heartbeat_timeout_seconds=int(dist_cfg.heartbeat_timeout_s))
    check_devices(cluster)
    return cluster


def check_devices(cluster: Cluster) -> None:
    """Every process must see the same number of devices (a node that sees one GPU of eight
    would otherwise build a mesh that does not exist)."""
    from jax.experimental import multihost_utils

    counts = multihost_utils.process_allgather(np.int32(jax.local_device_count()))
    if len(set(counts.tolist())) > 1:
        shown = ", ".join(f"process {i}: {n}" for i, n in enumerate(counts.tolist()))
        raise ConfigError("devices per process", shown, "every process must see the same number of devices; "
                          "check CUDA_VISIBLE_DEVICES / the scheduler's GPUs per task")


def job_description() -> str:
    """'2 processes x 4 devices' for messages (one process: its device count)."""
    if jax.process_count() == 1:
        return f"{jax.device_count()} devices"
    return f"{jax.process_count()} processes x {jax.local_device_count()} devices"


def leave(code: int) -> NoReturn:
    """End this process with exit code `code`, skipping the interpreter's teardown. In a
    multi-process job every process first leaves the coordination service together
    (`jax.distributed.shutdown` waits for the others). Teardown is skipped on purpose: threads of
    the runtime and of TensorStore that call back into Python can be cut off mid-call while the
    interpreter finalizes, which aborts a run that finished cleanly (exit -6 after the final
    checkpoint committed, seen with one process and with several). Everything of ours is closed
    before this is called; the output is flushed here."""
    if jax.distributed.is_initialized():
        try:
            jax.distributed.shutdown()
        except Exception as error:  # another process is already gone: nothing is left to coordinate
            print(f"jaxscale: note: process {jax.process_index()} left the job without the others: {error}",
                  file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
