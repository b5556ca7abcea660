"""validate(): every check on a run config, before anything compiles.

Each part owns the checks on its settings (`jaxscale.mesh.check`, `jaxscale.data.settings.check`,
...); this module only runs them in order, and no part imports it. The order decides which
error a config with several problems reports: keys and types first, then each part's own
settings, then how the model and batch meet the mesh, then data, checkpoint and tracking.
"""

from __future__ import annotations

from jaxscale import guard, mesh, optim, preference, sharding, tracking
from jaxscale.analysis import mfu
from jaxscale.checkpoint import settings as checkpoint_settings
from jaxscale.config import check_keys
from jaxscale.data import settings as data_settings
from jaxscale.errors import require_non_negative, require_positive
from jaxscale.models import checks as model_checks
from jaxscale.parallel import context, microbatch, pipeline
from jaxscale.runtime import distributed, health, profiler


def validate(config, device_count: int, granules: int = 1) -> None:
    """Check everything before anything compiles; raise ConfigError naming field, value, fix.

    `granules` is the number of hosts (or TPU slices) the devices span.
    """
    check_keys(config)
    _check_settings(config)
    _check_parallelism(config, device_count, granules)
    data_settings.check(config)
    checkpoint_settings.check(config)
    tracking.check(config)


def _check_settings(config) -> None:
    """The checks that need only the config."""
    model_checks.check_model(config)
    model_checks.check_lora(config)
    _check_train(config)
    for part in (optim, guard, preference, distributed, health, profiler, mfu):
        part.check(config)


def _check_train(config) -> None:
    # `train` is the run's shape, read by the data, the model, the microbatching and the loop
    # alike, so its ranges are checked here; how it meets the mesh is each part's check.
    require_positive(config, ("train.steps", "train.global_batch_size", "train.seq_len", "train.grad_accum_steps",
                              "train.log_every", "train.eval_batches"))
    require_non_negative(config, ("train.eval_every",))


def _check_parallelism(config, device_count: int, granules: int) -> None:
    """The mesh, then every part that must divide over it."""
    sizes = mesh.check(config, device_count, granules)
    rules = sharding.check_rules(config, sizes)
    model_checks.check_moe(config, sizes, rules)
    model_checks.check_layer_kinds(config, sizes)
    model_checks.check_prediction(config, sizes)
    pipeline.check(config, sizes)
    context.check(config, sizes)
    sharding.check_layout(config, rules, sizes)
    microbatch.check(config, sizes)
