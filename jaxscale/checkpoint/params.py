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
    a step's directory is given). Every array's digest is verified. A LoRA run's checkpoint
    holds its adapters: the frozen base comes from its checkpoint.init_from (or its seed), and
    the tree returned holds both (models.lora.folded merges them)."""
    from jaxscale.models import model_from_config
    from jaxscale.state import seeded_params, trained_and_frozen

    directory, step = locate(path, field)
    with Checkpointer(directory, config_lib.defaults().checkpoint, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise ConfigError(field, path, "holds no committed checkpoint yet")
        config = config_lib.from_dict(checkpointer.read_json(step)[2])
        model, _ = model_from_config(config, jax.default_backend())
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), model.shapes)
        trained, frozen = trained_and_frozen(model, target)
        params = _read(checkpointer, trained, step)
    if not frozen:
        return config, params, step
    from jaxscale.models import lora

    source = config.checkpoint.init_from
    if source:
        base = load_params(source, device, "checkpoint.init_from")[1]
    else:
        base = lora.split(jax.device_put(seeded_params(model, config.train.seed), sharding))[1]
    return config, lora.merge(params, base), step


def _read(checkpointer: Checkpointer, target: dict, step: int) -> dict:
    return checkpointer.restore(types.SimpleNamespace(params=target), params_only=True, step=step).state["params"]
