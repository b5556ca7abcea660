"""Host offload: optimizer state (and parameters) in pinned host memory give the same numbers as
keeping them on the devices; checkpoints move between the two; the planner shows host bytes."""

import jax
import numpy as np
import pytest

from jaxscale import Trainer
from jaxscale.errors import ConfigError
from jaxscale.offload import OffloadSpec, check_supported
from jaxscale.plan import make_plan
from jaxscale.runtime.loop import train


def _numbers(records):
    return [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in records]


def test_offload_gives_the_same_numbers_and_resumes_either_way(tiny_config, tmp_path):
    tiny_config.train.update(steps=6, log_every=1, eval_every=3)
    kept = train(tiny_config, tmp_path / "kept", show_progress=False)
    tiny_config.offload.update(optimizer_state=True, params=True)
    first = train(tiny_config, tmp_path / "offloaded", show_progress=False, until=3)
    with Trainer(tiny_config, tmp_path / "offloaded") as trainer:
        state = trainer.state
        assert state.params["embed"].sharding.memory_kind == "pinned_host"
        assert {m.sharding.memory_kind for m in jax.tree.leaves(state.opt_state) if m.ndim} == {"pinned_host"}
        logits = trainer.logits(np.arange(8))
        assert np.isfinite(logits).all()
    tiny_config.offload.update(optimizer_state=False, params=False)  # the checkpoint resumes on the devices
    rest = train(tiny_config, tmp_path / "offloaded", show_progress=False)
    assert _numbers(first + rest) == _numbers(kept)  # bit-identical


def test_the_planner_shows_host_bytes(tiny_config):
    tiny_config.offload.optimizer_state = True
    plan = make_plan(tiny_config)
    host, everything = plan["host_bytes"]["opt_state"], plan["per_device_bytes"]["opt_state"]
    assert 0 < host and everything - host == 8  # the moments; Adam's and the schedule's step counts stay
    assert plan["host_bytes"]["params"] == 0


def test_a_backend_without_host_memory_refuses_offload():
    class DeviceWithoutHostMemory:
        platform = "someaccel"

        def addressable_memories(self):
            return [type("Memory", (), {"kind": "device"})()]

    check_supported(OffloadSpec(), [DeviceWithoutHostMemory()])
    with pytest.raises(ConfigError, match="offload.optimizer_state=True: someaccel devices have no pinned_host"):
        check_supported(OffloadSpec(optimizer_state=True), [DeviceWithoutHostMemory()])
