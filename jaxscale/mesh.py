"""The device mesh: named axes, outer (slow links) to inner (fast links)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxscale.errors import ConfigError

# Outer -> inner: axes that talk least sit outermost so they can cross slow links.
AXES = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")
# Axes whose devices each hold a different slice of the batch.
BATCH_AXES = ("data", "fsdp")


def resolve_shape(mesh_cfg, device_count: int) -> dict[str, int]:
    """Axis sizes with the one -1 replaced by the devices left; errors name the field."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}", size, "use a positive size, or -1 for 'the remaining devices'")
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh.{free[1]}", -1, f"only one axis may be -1 (mesh.{free[0]} already is)")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if device_count % fixed:
            raise ConfigError(f"mesh.{free[0]}", -1, f"the other axes multiply to {fixed}, which does not divide {device_count} devices")
        sizes[free[0]] = device_count // fixed
    elif fixed != device_count:
        shown = "x".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        worst = max(sizes, key=sizes.get)
        raise ConfigError(f"mesh.{worst}", sizes[worst], f"the mesh ({shown}) has {fixed} devices but {device_count} are available; make the axis sizes multiply to {device_count} or set one to -1")
    return sizes


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) with every axis of AXES, in Auto mode."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[axis] for axis in AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return Mesh(np.array(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
