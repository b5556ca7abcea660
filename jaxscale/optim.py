"""The optimizer from config: AdamW, warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

import jax
import optax

from jaxscale.errors import require_choice, require_non_negative, require_positive
from jaxscale.names import GRAD_REDUCE_DTYPES


def check(config) -> None:
    """The `optim` settings are usable; raises ConfigError naming the field."""
    require_positive(config, ("optim.lr",))
    require_non_negative(config, ("optim.warmup_steps", "optim.weight_decay", "optim.clip_norm", "optim.min_lr_ratio"))
    require_choice("optim.grad_reduce_dtype", config.optim.grad_reduce_dtype, GRAD_REDUCE_DTYPES)


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    """Linear warmup to optim.lr over warmup_steps, then cosine decay to lr * min_lr_ratio."""
    warmup = min(optim_cfg.warmup_steps, max(total_steps - 1, 0))
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim_cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=optim_cfg.lr * optim_cfg.min_lr_ratio)
    # Shifted by one so the first update already learns (lr/warmup rather than 0).
    return lambda count: base(count + 1)


def decay_mask(params: dict) -> dict:
    """Weight decay applies to matrices and embeddings, never to norm scales or biases."""
    def decays(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name == "scale" or name.startswith("bias"))
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(optim_cfg, total_steps)
    adamw = optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                        weight_decay=optim_cfg.weight_decay, mask=decay_mask)
    if optim_cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optim_cfg.clip_norm), adamw), schedule
    return adamw, schedule
