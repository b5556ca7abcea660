"""Preference tuning on pairs of completions: DPO (Rafailov et al., 2023) and SimPO (Meng et al., 2024).

A batch holds pair i as its rows 2i (the chosen completion) and 2i+1 (the rejected one) of the same
prompt (jaxscale.data.pairs); each row's trained targets (the mask) are its completion's tokens.
A completion's log-probability under a model, log π(y|x), is the sum of its tokens'.

- `dpo`, TRL's loss_type="sigmoid": -log σ(β ((log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))))
  with the reference π_ref the model the run started from, frozen: under LoRA the base without its
  adapters, else a copy of the starting parameters kept in the state (TrainState.base), split as
  the trained ones, with no gradients and no optimizer state. Its log-probabilities are computed in
  the same step, outside the gradient.
- `simpo`: -log σ(β (log π(c) / |c| - log π(r) / |r|) - γ), length-normalised and without a
  reference (TRL's CPOTrainer with loss_type="simpo").

The loss is the mean over the batch's pairs. Metrics, as TRL logs them: rewards_chosen and
rewards_rejected (β times the completion's log-ratio to the reference; SimPO: its mean
log-probability), reward_accuracy (the share of pairs whose chosen reward is the larger) and
reward_margin (their mean difference). The log-probabilities come from the head's chunked
vocabulary-parallel pass (models.vocab), as the language-model loss does: no [rows, length,
vocabulary] logits are formed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, require, require_choice, require_non_negative, require_positive
from jaxscale.models.vocab import IGNORE
from jaxscale.names import PREFERENCE_LOSSES

METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")


@dataclasses.dataclass(frozen=True)
class PreferenceSpec:
    """config.preference; hashable, so the jitted step can close over it."""

    loss: str = "none"    # none | dpo | simpo
    beta: float = 0.1     # DPO's β (TRL's default 0.1); SimPO's (its paper's 2.0 to 2.5)
    gamma: float = 0.5    # SimPO's target reward margin γ

    @classmethod
    def from_config(cls, config) -> PreferenceSpec:
        return cls(**{f.name: config.preference[f.name] for f in dataclasses.fields(cls)})

    @property
    def on(self) -> bool:
        return self.loss != "none"

    @property
    def needs_reference(self) -> bool:
        """Whether the step needs the reference model's log-probabilities (DPO's)."""
        return self.loss == "dpo"

    @property
    def metric_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: () for name in METRICS} if self.on else {}


def keeps_copy(spec: PreferenceSpec, model) -> bool:
    """Whether the state keeps a frozen copy of the starting parameters as the reference: DPO
    without LoRA (under LoRA the frozen base is the reference)."""
    return spec.needs_reference and not model.spec.lora.on


def check(config) -> None:
    """The `preference` settings are usable with the rest of the run; ConfigError naming the field."""
    p, m, t = config.preference, config.model, config.train
    require_choice("preference.loss", p.loss, PREFERENCE_LOSSES)
    require_positive(config, ("preference.beta",))
    require_non_negative(config, ("preference.gamma",))
    if p.loss == "none":
        return
    rows = t.global_batch_size // max(t.grad_accum_steps, 1)
    require(t.global_batch_size % (2 * t.grad_accum_steps) == 0, "train.global_batch_size", t.global_batch_size,
            f"preference tuning reads pairs of rows: make each of the {t.grad_accum_steps} microbatches an even "
            f"number of rows (now {rows})")
    for field, value, refused, what in (
            ("mesh.pipeline", config.mesh.pipeline, config.mesh.pipeline > 1, "pipeline stages"),
            ("model.moe.num_experts", m.moe.num_experts, m.moe.num_experts > 0, "a mixture of experts"),
            ("model.mtp_depth", m.mtp_depth, m.mtp_depth > 0, "multi-token prediction"),
            ("model.z_loss_weight", m.z_loss_weight, m.z_loss_weight > 0, "the logits' z-loss")):
        if refused:
            raise ConfigError(field, value, f"preference.loss={p.loss} does not take {what} yet; drop it for "
                              "preference tuning")


def log_probs(model, weights: dict, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """(each row's summed log-probability of its trained targets [rows], how many they are [rows],
    the router's statistics) in float32; untrained targets are vocab.IGNORE (step.trained)."""
    losses, targets, stats = model.token_losses(weights, batch["inputs"], batch["targets"], batch.get("segments"),
                                                batch.get("seeds"))
    kept = targets != IGNORE
    return -jnp.sum(jnp.where(kept, losses, 0.0), axis=1), jnp.sum(kept, axis=1, dtype=jnp.float32), stats


def pair_losses(spec: PreferenceSpec, logps, lengths, reference=None) -> tuple[jax.Array, jax.Array]:
    """(each pair's loss [pairs], its (chosen, rejected) rewards [pairs, 2]) from the rows'
    log-probabilities and lengths, and the reference's log-probabilities (DPO)."""
    if spec.loss == "dpo":
        rewards = spec.beta * (logps - reference).reshape(-1, 2)
        return -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1]), rewards
    rewards = spec.beta * (logps / jnp.maximum(lengths, 1.0)).reshape(-1, 2)
    return -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1] - spec.gamma), rewards


def loss(spec: PreferenceSpec, model, weights: dict, reference: dict | None, batch: dict) -> tuple[jax.Array, dict]:
    """(training objective, metrics) of a batch of pairs: the mean loss over its pairs, plus what
    the model's statistics add (an MoE model's router losses)."""
    logps, lengths, stats = log_probs(model, weights, batch)
    ref = jax.lax.stop_gradient(log_probs(model, reference, batch)[0]) if spec.needs_reference else None
    losses, rewards = pair_losses(spec, logps, lengths, ref)
    rewards = jax.lax.stop_gradient(rewards)
    mean = jnp.mean(losses)
    metrics = {"loss": mean, "rewards_chosen": jnp.mean(rewards[:, 0]), "rewards_rejected": jnp.mean(rewards[:, 1]),
               "reward_accuracy": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
               "reward_margin": jnp.mean(rewards[:, 0] - rewards[:, 1]), **stats}
    return mean + model.extra_loss(stats), metrics
