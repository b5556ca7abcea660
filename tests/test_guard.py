"""Training guards: non-finite updates are skipped in the step, loss spikes are detected
against a window of recent losses, and a rollback run reloads the checkpoint before a spike."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import guard as guard_lib
from jaxscale.build import build
from jaxscale.data import make_data
from jaxscale.guard import GuardSpec
from jaxscale.runtime.loop import train


def _guard(losses, seen):
    state = guard_lib.init(GuardSpec(spike_window=len(losses)))
    return dict(state, losses=jnp.asarray(losses, jnp.float32), seen=jnp.int32(seen))


def test_spike_needs_a_full_window_and_the_threshold():
    spec = GuardSpec(spike_threshold=3.0, spike_window=4)
    window = [2.0, 2.2, 1.8, 2.0]  # mean 2.0, std 0.1414: the band ends at 2.424
    full, filling = _guard(window, 4), _guard(window, 3)
    for loss, spike in ((2.42, False), (2.43, True), (9.0, True)):
        assert bool(guard_lib.is_spike(spec, full, jnp.float32(loss))) is spike, loss
    assert not bool(guard_lib.is_spike(spec, filling, jnp.float32(9.0)))
    assert not bool(guard_lib.is_spike(GuardSpec(spike_threshold=0.0, spike_window=4), full, jnp.float32(9.0)))


def test_decide_counts_skips_and_keeps_rejected_losses_out_of_the_window():
    spec = GuardSpec(spike_threshold=3.0, spike_window=4)
    state = _guard([2.0, 2.2, 1.8, 2.0], 4)
    accept, spike, after = guard_lib.decide(spec, state, jnp.float32(9.0), jnp.float32(1.0))
    assert (bool(accept), bool(spike), int(after["spikes"]), int(after["seen"])) == (False, True, 1, 4)
    np.testing.assert_array_equal(after["losses"], state["losses"])
    accept, spike, after = guard_lib.decide(spec, after, jnp.float32(np.nan), jnp.float32(1.0))
    assert (bool(accept), bool(spike), int(after["nonfinite"])) == (False, False, 1)
    accept, _, after = guard_lib.decide(spec, after, jnp.float32(2.1), jnp.float32(1.0))
    assert bool(accept) and int(after["seen"]) == 5 and float(after["losses"][0]) == np.float32(2.1)  # ring slot 4 % 4
    accept, _, _ = guard_lib.decide(GuardSpec(skip_nonfinite=False), guard_lib.init(GuardSpec()),
                                    jnp.float32(np.inf), jnp.float32(1.0))
    assert bool(accept)  # opted out: the update goes through


def test_a_nonfinite_step_leaves_params_and_optimizer_state_unchanged(tiny_config):
    run = build(tiny_config)
    batch = next(make_data(tiny_config, run.batch_sharding).train_batches(0))
    fresh = run.init_state()
    poisoned = dict(fresh.params, embed=fresh.params["embed"].at[batch["inputs"][0, 0]].set(jnp.nan))
    before = jax.device_get(dict(params=poisoned, opt_state=fresh.opt_state))
    state, metrics = run.train_step(type(fresh)(**{**vars(fresh), "params": poisoned}), batch)
    assert not np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_skips"]) == 1
    assert int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(dict(params=state.params, opt_state=state.opt_state)),
                 before)


def _spiky_text(path, seed=0):
    """One repeated byte, which the model learns within a few steps, with one short burst of
    random bytes: the few batches holding a window of the burst have a far higher loss."""
    noise = np.random.default_rng(seed).integers(0, 256, 120, dtype=np.uint8).tobytes()
    path.write_bytes(b"a" * 12_000 + noise + b"a" * 8_000)
    return path


def test_rollback_reloads_the_checkpoint_before_a_spike(tiny_config, tmp_path, capsys):
    tiny_config.data.path = str(_spiky_text(tmp_path / "spiky.txt"))
    tiny_config.train.update(steps=40, eval_every=0, log_every=1)
    tiny_config.checkpoint.update(every_steps=4, max_to_keep=5)
    tiny_config.guard.update(spike_threshold=3.0, spike_window=8, spike_action="rollback")
    records = train(tiny_config, tmp_path / "run", show_progress=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollback:")]
    assert lines, "no spike triggered a rollback: the test data no longer spikes"
    assert records[-1]["step"] == 40 and np.isfinite(records[-1]["loss"])
    steps = [r["step"] for r in records]
    assert len(steps) > len(set(steps))  # steps after the restored checkpoint ran again
    position = json.loads((tmp_path / "run" / "checkpoints" / "40" / "data" / "metadata").read_text())
    assert position["rollbacks"] == len(lines)
    assert position["global_sample"] > 40 * tiny_config.train.global_batch_size  # the spiky batches were skipped
