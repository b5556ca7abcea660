"""A checkpoint's parameters and the config they were trained with, for using a model rather
than training it (generation, export): no optimizer state is read."""

from __future__ import annotations

import types

import jax

from jaxscale import config as config_lib
from jaxscale.checkpoint.manager import Checkpointer
from jaxscale.checkpoint.sources import locate
from jaxscale.errors import ConfigError


def load_params(path: str, device=None, field: str = "--workdir") -> tuple[object, dict, int]:
    """(config, float32 params on `device` (default: the first), step) of the checkpoint at `path`
    (a workdir, its checkpoints/ directory or one step's directory; newest committed step unless
    a step's directory is given). Every array's digest is verified."""
    from jaxscale.models import model_from_config

    directory, step = locate(path, field)
    with Checkpointer(directory, config_lib.defaults().checkpoint, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise ConfigError(field, path, "holds no committed checkpoint yet")
        config = config_lib.from_dict(checkpointer.read_json(step)[2])
        model, _ = model_from_config(config, jax.default_backend())
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), model.shapes)
        restored = checkpointer.restore(types.SimpleNamespace(params=target), params_only=True, step=step)
    return config, restored.state["params"], step
