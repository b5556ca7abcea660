"""Training guards, decided inside the jitted step: skip updates whose loss or gradients are not
finite, and (optionally) updates whose loss spikes above a window of recent losses.

A skipped step still consumes its batch and advances `state.step`, but leaves the parameters
and the whole optimizer state (moments and schedule count) unchanged, as optax's
apply_if_finite does. The guard's own state (loss window, counters) lives in the TrainState,
so it is checkpointed with it and a resumed run makes the same decisions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxscale.errors import require_choice, require_non_negative, require_positive
from jaxscale.names import SPIKE_ACTIONS


def check(config) -> None:
    """The `guard` settings are usable; raises ConfigError naming the field."""
    require_choice("guard.spike_action", config.guard.spike_action, SPIKE_ACTIONS)
    require_positive(config, ("guard.spike_window",))
    require_non_negative(config, ("guard.spike_threshold",))


@dataclasses.dataclass(frozen=True)
class GuardSpec:
    """What the step guards against; hashable, so the jitted step can close over it."""

    skip_nonfinite: bool = True    # a NaN/inf loss or gradient norm skips the update
    spike_threshold: float = 0.0   # a loss this many standard deviations above the window's mean is a spike; 0 = off
    spike_window: int = 100        # recent (accepted) losses the spike test compares against; it needs a full window
    spike_action: str = "skip"     # skip: drop the update in-graph | rollback: also reload the last checkpoint

    @classmethod
    def from_config(cls, guard_cfg) -> GuardSpec:
        return cls(**{f.name: guard_cfg[f.name] for f in dataclasses.fields(cls)})


def init(spec: GuardSpec) -> dict:
    """The guard's state: a ring buffer of recent losses and cumulative skip counters."""
    return {"losses": jnp.zeros((spec.spike_window,), jnp.float32), "seen": jnp.zeros((), jnp.int32),
            "nonfinite": jnp.zeros((), jnp.int32), "spikes": jnp.zeros((), jnp.int32)}


def is_spike(spec: GuardSpec, guard: dict, loss: jax.Array) -> jax.Array:
    """Whether `loss` exceeds mean + threshold·std of a full window of recent losses."""
    if spec.spike_threshold <= 0:
        return jnp.zeros((), bool)
    window = guard["losses"]
    full = guard["seen"] >= spec.spike_window
    return full & (loss > window.mean() + spec.spike_threshold * window.std())


def decide(spec: GuardSpec, guard: dict, loss: jax.Array, grad_norm: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """(accept the update?, was it a spike?, the guard's next state)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spike = finite & is_spike(spec, guard, loss)
    accept = ~spike & (finite if spec.skip_nonfinite else True)
    # Only accepted losses enter the window, so a spike or a NaN never widens the band.
    slot = guard["seen"] % spec.spike_window
    losses = jnp.where(accept, guard["losses"].at[slot].set(loss.astype(jnp.float32)), guard["losses"])
    new = {"losses": losses, "seen": guard["seen"] + accept.astype(jnp.int32),
           "nonfinite": guard["nonfinite"] + (~finite).astype(jnp.int32),
           "spikes": guard["spikes"] + spike.astype(jnp.int32)}
    return accept, spike, new


def select(accept: jax.Array, new, old):
    """`new` where the update is accepted, else `old`, leaf by leaf (fuses into the update)."""
    return jax.tree.map(lambda n, o: jnp.where(accept, n, o), new, old)
