"""Preference tuning (jaxscale.preference, jaxscale.data.pairs): TRL's losses on the same
log-probabilities, pairs read as row pairs, the same step on data x fsdp x tensor with
accumulation as on one device with the reference kept frozen and split like the policy, and a
tiny DPO run that learns its pairs."""

import json
import math
import shutil

import jax
import numpy as np
import pytest

from conftest import main_cli, small_config
from jaxscale.analysis.step_plan import compile_plan, describe
from jaxscale.data import pairs
from jaxscale.data.tokenize import load_tokenizer
from jaxscale.errors import ConfigError
from jaxscale.preference import PreferenceSpec, pair_losses
from jaxscale.validate import validate


def test_the_losses_are_trls_on_the_same_log_probabilities():
    """DPO: TRL 1.16 DPOTrainer, loss_type="sigmoid"; SimPO: TRL's CPOTrainer, loss_type="simpo",
    both written in torch as TRL computes them, on the same per-sequence log-probabilities."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    logps, ref = rng.normal(-40, 15, 16), rng.normal(-40, 15, 16)  # rows: chosen, rejected, chosen, ...
    lengths = rng.integers(1, 60, 16).astype(np.float64)
    c, r, rc, rr = (torch.tensor(x) for x in (logps[0::2], logps[1::2], ref[0::2], ref[1::2]))
    beta, gamma = 0.1, 0.5
    trl_dpo = -F.logsigmoid(beta * ((c - rc) - (r - rr)))
    got, rewards = pair_losses(PreferenceSpec("dpo", beta, gamma), logps, lengths, ref)
    np.testing.assert_allclose(got, trl_dpo.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rewards, beta * np.stack([c - rc, r - rr], 1), rtol=1e-6)  # TRL's rewards/chosen, ...
    beta = 2.0
    c_avg, r_avg = c / torch.tensor(lengths[0::2]), r / torch.tensor(lengths[1::2])
    trl_simpo = -F.logsigmoid(beta * ((c_avg - r_avg) - gamma / beta))
    got, _ = pair_losses(PreferenceSpec("simpo", beta, gamma), logps, lengths)
    np.testing.assert_allclose(got, trl_simpo.numpy(), rtol=1e-6)


def _write_pairs(path, count: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    words = "apple river stone cloud green quick seven lamp ocean paper".split()
    with open(path, "w") as f:
        for _ in range(count):
            prompt = list(rng.choice(words, 4))
            f.write(json.dumps({"prompt": f"Q: {' '.join(prompt)}\nA:", "chosen": " " + " ".join(prompt[::-1]),
                                "rejected": " " + " ".join(rng.choice(words, 4))}) + "\n")
    return path


def test_a_pair_is_two_rows_whose_completions_are_trained(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "0123456789", "chosen": "ab", "rejected": "xyz"}) + "\n")
    tokenizer = load_tokenizer("bytes")
    tokens, mask = pairs.encode(path, None, tokenizer, seq_len=15)
    assert tokens.shape == mask.shape == (1, 2, 16)
    eos = tokenizer.eos_id
    assert bytes(tokens[0, 0, :12].tolist()) == b"0123456789ab" and tokens[0, 0, 12] == eos
    assert mask[0, 0].tolist() == [0] * 10 + [1, 1, 1] + [0] * 3  # the completion and its EOS; padding untrained
    # Too long: the prompt's first tokens go (6 of them for 10 + 3 + EOS in 8), the completion stays whole.
    tokens, mask = pairs.encode(path, None, tokenizer, seq_len=7)
    assert tokens[0, 1].tolist() == [*b"6789xyz", eos] and mask[0, 1].tolist() == [0] * 4 + [1] * 4
    # Shuffled as pairs, read as rows: 2i chosen, 2i+1 rejected of one pair.
    rows = pairs.Rows(pairs.PairWindows(*pairs.encode(path, None, tokenizer, 15), eos_id=None))
    assert rows[0]["targets"][9:11].tolist() == list(b"ab") and rows[1]["targets"][9:12].tolist() == list(b"xyz")


@pytest.mark.parametrize("overrides, field, words", [
    (["preference.loss='kto'"], "preference.loss", "dpo"),
    (["preference.loss='dpo'", "preference.beta=0.0"], "preference.beta", "must be > 0"),
    (["preference.loss='dpo'"], "preference.loss", "data.path=PAIRS.jsonl"),
    (["preference.loss='dpo'", "data.path='p.jsonl'", "train.global_batch_size=6", "train.grad_accum_steps=2"],
     "train.global_batch_size", "even number of rows (now 3)"),
    (["preference.loss='simpo'", "data.path='p.jsonl'", "model.z_loss_weight=0.1"], "model.z_loss_weight",
     "z-loss"),
])
def test_bad_preference_settings_are_refused_in_one_line(overrides, field, words):
    from jaxscale import config as config_lib

    config = small_config()
    config_lib.apply_overrides(config, overrides)
    with pytest.raises(ConfigError) as info:
        validate(config, 1)
    assert info.value.field == field and words in str(info.value) and "\n" not in str(info.value)


def _config(**mesh):
    config = small_config()
    config.preference.update(loss="dpo", beta=0.5)
    config.data.path = "pairs.jsonl"  # compiling reads no data: the batch below stands for it
    config.train.update(global_batch_size=8, grad_accum_steps=2)
    config.optim.update(lr=1e-2, warmup_steps=0)
    config.mesh.update({"data": 1, **mesh})
    return config


def _batch(config, run):
    """Four pairs of random rows whose completions (the mask) have uneven lengths."""
    t, rng = config.train, np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, (t.global_batch_size, t.seq_len + 1))
    starts = rng.integers(4, t.seq_len - 4, t.global_batch_size)
    mask = (np.arange(t.seq_len)[None] >= starts[:, None]).astype(np.int32)
    return jax.device_put({"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
                           "mask": mask}, run.batch_sharding)


def _train(config, steps: int = 3):
    """Each step's metrics, checked against the eval step's on the same batch and parameters:
    validation measures the objective the step trains (the eval of its two microbatches at once)."""
    devices = jax.devices()[:math.prod(config.mesh.values())]
    run, compiled, seconds = compile_plan(config, "cpu", devices)
    batch, state, history = _batch(config, run), run.init_state(), []
    names = ("loss", "reward_accuracy", "reward_margin", "rewards_chosen")
    for _ in range(steps):
        held_out = run.eval_step(state.params, state.base, batch)
        state, metrics = compiled(state, batch)
        history.append({k: float(metrics[k]) for k in names})
        assert {k: float(held_out[k]) for k in names} == pytest.approx(history[-1], rel=1e-5, abs=1e-6)
    return history, describe(config, run, compiled, seconds)


def test_dpo_on_data_fsdp_and_tensor_with_accumulation_equals_one_device():
    one, _ = _train(_config())
    split, plan = _train(_config(data=2, fsdp=2, tensor=2))
    for a, b in zip(one, split):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert one[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy starts as its reference
    assert one[-1]["loss"] < one[0]["loss"] and one[-1]["reward_margin"] > 0
    # The reference: a frozen copy of the starting parameters, split as they are, with no
    # optimizer state (Adam's two moments are the trained parameters' alone).
    rows = plan.per_device_bytes
    assert rows.frozen == rows.params > 0 and rows.opt_state == pytest.approx(2 * rows.params, rel=0.01)


def test_a_tiny_dpo_run_learns_its_pairs(tmp_path):
    """LoRA's base is the reference. Each batch holds all 8 training pairs (9 written, 1 held out
    and evaluated at the end), so the step's reward accuracy is over every training pair. Over 5
    seeds (data and train.seed 0-4) the accuracy was 1.0 from step 10 on, and the loss at step 30
    0.010 to 0.022."""
    data = _write_pairs(tmp_path / "pairs.jsonl")
    result = main_cli(["--config=configs/tiny.py", f"--config.data.path={data}", "--config.preference.loss=dpo",
                       "--config.model.lora.rank=8", "--config.train.steps=30", "--config.train.global_batch_size=16",
                       "--config.train.seq_len=48", "--config.train.log_every=10", "--config.train.eval_every=30",
                       "--config.optim.warmup_steps=5", "--config.checkpoint.every_steps=0",
                       f"--workdir={tmp_path / 'run'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "preference data: 9 pairs" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # B = 0: the policy is its base
    assert records[-1]["step"] == 30 and records[-1]["reward_accuracy"] > 0.9, records[-1]
    assert records[-1]["loss"] < 0.1 and records[-1]["reward_margin"] > 0
    # Evaluated on the held-out pair: the preference loss and its rewards, not a cross entropy.
    last = records[-1]
    assert last["val_reward_accuracy"] in (0.0, 1.0) and last["val_loss"] > 0
    assert last["val_reward_margin"] == pytest.approx(last["val_rewards_chosen"] - last["val_rewards_rejected"])


def test_dpo_without_lora_resumes_bit_identically_with_its_reference_drawn_again(tmp_path):
    """Checkpoints leave the reference copy out; a run resumed from the uninterrupted run's step 2
    (copied into another workdir) draws it again from train.seed (the parameters it started from),
    and its losses are the uninterrupted run's, bit for bit."""
    data = _write_pairs(tmp_path / "pairs.jsonl")
    args = ["--config=configs/tiny.py", f"--config.data.path={data}", "--config.preference.loss=dpo",
            "--config.train.global_batch_size=16", "--config.train.seq_len=48", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.optim.warmup_steps=0", "--config.optim.min_lr_ratio=1.0",
            "--config.checkpoint.every_steps=2", "--config.train.steps=4"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = main_cli([*args, f"--workdir={whole}"])
    assert result.returncode == 0, result.stderr[-2000:]
    shutil.copytree(whole / "checkpoints" / "2", resumed / "checkpoints" / "2")
    result = main_cli([*args, f"--workdir={resumed}"])
    assert result.returncode == 0, result.stderr[-2000:]
    first, then = ([json.loads(line) for line in (run / "metrics.jsonl").open()] for run in (whole, resumed))
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in then] == [3, 4]
    assert [r["loss"] for r in then] == [r["loss"] for r in first[2:]]


def test_the_chunked_heads_token_losses_are_the_full_logits_on_a_split_vocabulary():
    """The log-probabilities a preference loss sums come from the head's chunked pass
    (LanguageModel.token_losses), never the [B, L, V] logits; on fsdp=2 x tensor=2 (the vocabulary
    split over tensor) their per-row weighted sum and its gradients are the full logits' (measured
    2.9e-6 apart, float32)."""
    import jax.numpy as jnp

    from jaxscale.build import build
    from jaxscale.models.vocab import IGNORE

    config = small_config()
    config.mesh.update(data=1, fsdp=2, tensor=2)
    run = build(config, jax.devices()[:4])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, (4, 33)).astype(np.int32)
    inputs, targets = tokens[:, :-1], np.where(np.arange(32) < 5, IGNORE, tokens[:, 1:])
    weights = rng.normal(size=(4, 1)).astype(np.float32)  # a per-row cotangent, as a preference loss gives

    def chunked(params):
        losses, laid_out, _ = run.model.token_losses(params, inputs, targets)
        return jnp.sum(weights * jnp.where(laid_out != IGNORE, losses, 0.0))

    def full(params):
        log_probs = jax.nn.log_softmax(run.model.apply(params, inputs))
        picked = jnp.take_along_axis(log_probs, np.maximum(targets, 0)[..., None], -1)[..., 0]
        return jnp.sum(weights * jnp.where(targets != IGNORE, -picked, 0.0))

    params = run.init_state().params
    (a, grads_a), (b, grads_b) = (jax.jit(jax.value_and_grad(f))(params) for f in (chunked, full))
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(x, y, atol=2e-5)
