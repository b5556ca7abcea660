"""Host offload (ZeRO-Offload style): optimizer state, and optionally parameters, live in pinned
host memory between steps and are brought to the devices for the step.

`offload.optimizer_state=True` keeps every Adam moment on the host; `offload.params=True` also the
float32 master parameters. Inside the jitted step they are moved to device memory (JAX memory
kinds), used, and the updated values written back to the host by the step's output shardings,
so device memory holds them only while the step runs. Backends without a pinned-host memory
refuse with a one-line error.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding

from jaxscale.errors import ConfigError

HOST, DEVICE = "pinned_host", "device"


@dataclasses.dataclass(frozen=True)
class OffloadSpec:
    optimizer_state: bool = False
    params: bool = False

    @classmethod
    def from_config(cls, offload_cfg) -> OffloadSpec:
        return cls(optimizer_state=offload_cfg.optimizer_state, params=offload_cfg.params)

    @property
    def any(self) -> bool:
        return self.optimizer_state or self.params


def check_supported(spec: OffloadSpec, devices) -> None:
    """ConfigError unless the devices have pinned host memory to offload into."""
    if not spec.any:
        return
    kinds = {memory.kind for memory in devices[0].addressable_memories()}
    if HOST not in kinds:
        field = "offload.optimizer_state" if spec.optimizer_state else "offload.params"
        raise ConfigError(field, True, f"{devices[0].platform} devices have no {HOST} memory (only "
                          f"{', '.join(sorted(kinds))}); turn offload off on this backend")


def to_host(shardings):
    """The same placements in pinned host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def to_device_kind(shardings):
    """The same placements in device memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE) if isinstance(s, NamedSharding) else s, shardings)


def on_device(tree, shardings):
    """Inside jit: `tree` (placed by `shardings`) in device memory; a no-op for device-resident leaves."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE))
                        if isinstance(s, NamedSharding) and s.memory_kind == HOST else x, tree, shardings)


def has_host(shardings) -> bool:
    """Whether any leaf is placed in pinned host memory."""
    return any(getattr(s, "memory_kind", None) == HOST for s in jax.tree.leaves(shardings))
