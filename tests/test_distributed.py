"""Which job a process belongs to, from the config or the scheduler's environment; the
launcher's flags; straggler arithmetic."""

import pytest

from conftest import ROOT
from jaxscale import cli
from jaxscale.config import defaults
from jaxscale.errors import ConfigError
from jaxscale.launch import child_env, parse
from jaxscale.mesh import axis_sizes
from jaxscale.runtime import distributed
from jaxscale.runtime.health import stragglers
from jaxscale.validate import validate

SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0"}
OMPI = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:5000", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5"}
K8S = {"JOB_COMPLETION_INDEX": "3", "JAXSCALE_NUM_PROCESSES": "4", "JAXSCALE_COORDINATOR": "train-0.train:1234",
       "KUBERNETES_SERVICE_HOST": "10.0.0.1"}


def _detect(env, **cfg):
    d = defaults().distributed
    d.update(cfg)
    return distributed.detect(d, env)


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    (SLURM, ("slurm", 4, 2, None, "slurm")),
    (dict(SLURM, SLURM_NTASKS="1"), None),  # one task: no job to join
    (OMPI, ("openmpi", 8, 5, None, "ompi")),
    (K8S, ("kubernetes", 4, 3, "train-0.train:1234", None)),
    (child_env(1, 2, 5555, 4, base={}), ("jaxscale.launch", 2, 1, "127.0.0.1:5555", None)),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "1"}, ("tpu", None, 1, None, None)),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, None),  # one host: a single process drives the slice
], ids=["none", "slurm", "slurm_one_task", "openmpi", "kubernetes", "launcher", "tpu_pod", "tpu_one_host"])
def test_detects_the_scheduler(env, expected):
    cluster = _detect(env)
    got = None if cluster is None else (cluster.source, cluster.num_processes, cluster.process_id,
                                        cluster.coordinator, cluster.method)
    assert got == expected


def test_a_slurm_or_mpi_task_drives_every_gpu_it_can_see():
    assert _detect(dict(SLURM, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")).local_device_ids == tuple(range(8))
    assert _detect(dict(OMPI, CUDA_VISIBLE_DEVICES="5")).local_device_ids == (0,)  # one per task: its own, as 0
    assert _detect(SLURM).local_device_ids is None  # CPU or unknown: JAX decides


def test_the_config_wins_over_the_environment():
    cluster = _detect(SLURM, coordinator_address="10.1.1.1:9000", num_processes=2, process_id=1)
    assert (cluster.source, cluster.num_processes, cluster.process_id, cluster.coordinator) == \
        ("config", 2, 1, "10.1.1.1:9000")


@pytest.mark.parametrize("env, cfg, match", [
    ({}, dict(coordinator_address="h:1"), "also set distributed.num_processes"),
    ({"JOB_COMPLETION_INDEX": "0"}, {}, "JAXSCALE_NUM_PROCESSES"),
    (dict(K8S, JAXSCALE_COORDINATOR=""), {}, "JAXSCALE_COORDINATOR"),
    (dict(SLURM, SLURM_PROCID="4"), {}, "process index=4: slurm says 4 processes"),
])
def test_incomplete_settings_are_one_line_errors(env, cfg, match):
    with pytest.raises(ConfigError, match=match):
        _detect(env, **cfg)


def test_launcher_flags_and_environment():
    flags, command = parse(["--nproc", "2", "--devices_per_proc=4", "--", "python", "-m", "x", "--nproc=9"])
    assert (flags.nproc, flags.devices_per_proc, flags.grace_s) == (2, 4, 30.0)
    assert (flags.max_restarts, flags.min_nproc) == (0, 2)  # no restarts; all processes needed
    assert command == ["python", "-m", "x", "--nproc=9"]  # everything after -- belongs to the command
    env = child_env(1, 2, 5555, 4, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"})
    assert env["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=4"
    for argv, message in ((["--nproc=2"], "missing the command"), (["--nproc=0", "--", "x"], "--nproc=0"),
                          (["--nproc=2", "--bogus=1", "--", "x"], "unrecognized arguments: --bogus=1"),
                          (["--nproc=2", "--max_restarts=-1", "--", "x"], "--max_restarts=-1"),
                          (["--nproc=2", "--min_nproc=3", "--", "x"], "--min_nproc=3: give a count between 1 and")):
        with pytest.raises(ValueError, match=message):
            parse(argv)


def test_stragglers_are_measured_against_the_others_median():
    assert stragglers([100.0, 105.0, 98.0, 140.0], threshold=0.2) == [(3, pytest.approx(140.0 / 100.0))]
    assert stragglers([15.0, 24.0], threshold=0.2) == [(1, pytest.approx(1.6))]  # two processes: the other one
    assert stragglers([10.0, 11.0], threshold=0.2) == []
    assert stragglers([2.0, 4.0], threshold=0.2, min_gap=5.0) == []  # twice as slow, but by 2 ms: noise


def _template_flags(path):
    """The --config flags of the jaxscale command in a cluster template."""
    import re

    text = (ROOT / path).read_text().replace('"$SLURM_NNODES"', "2")
    return re.findall(r"(--config[.=][^\s\"']+)", text)


@pytest.mark.parametrize("path", ["configs/cluster/slurm.sbatch", "configs/cluster/kubernetes.yaml"])
def test_cluster_templates_validate_for_two_hosts_of_eight_gpus(path):
    flags = _template_flags(path)
    config_path = next(f.split("=", 1)[1] for f in flags if f.startswith("--config="))
    overrides = [f.removeprefix("--config.") for f in flags if f.startswith("--config.")]
    config = cli.load_config(str(ROOT / config_path), overrides)
    validate(config, 16, granules=2)
    assert axis_sizes(config, 16, 2)["data"] == 2 and axis_sizes(config, 16, 2)["fsdp"] == 8
