"""Generation: decoding with a KV cache equals the full forward, greedy and sampled generation,
sharded parameters, and the `python -m jaxscale.generate` command on a trained checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_layout, run_cli, small_config
from jaxscale import generate as generate_cli
from jaxscale import sharding as shd
from jaxscale.errors import ConfigError
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.sampling import generate
from jaxscale.state import param_specs

# init_std well above the training default, so logits and attention are far from uniform.
SPECS = {
    "llama_gqa_untied": ModelSpec(family="llama", num_layers=2, d_model=48, num_heads=6, num_kv_heads=2,
                                  d_ff=96, vocab_size=100, tie_embeddings=False, init_std=0.2),
    "gpt2_tied": ModelSpec(family="gpt2", num_layers=2, d_model=48, num_heads=4, num_kv_heads=4,
                           d_ff=96, vocab_size=100, max_seq_len=32, init_std=0.2),
}
PROMPT = [5, 17, 42, 8, 99, 0, 23]


@pytest.fixture(scope="module", params=SPECS)
def model_and_params(request):
    model = LanguageModel(SPECS[request.param])
    return model, jax.jit(model.init)(jax.random.PRNGKey(0))


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 100, shape), jnp.int32)


def test_decode_equals_the_full_forward(model_and_params):
    """Prefill 5 tokens, decode a chunk of 3, then one token per call: the logits of every
    position equal the full forward's over the whole sequence."""
    model, params = model_and_params
    tokens, length = _tokens((2, 14)), 14
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    cache = model.init_cache(2, 16, jnp.float32)
    assert cache["global"]["k"].shape == (2, 2, 16, model.spec.num_kv_heads, 48 // model.spec.num_heads)
    decode = jax.jit(model.decode)
    pieces = []
    for start, stop in [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, length)]:
        logits, cache = decode(params, tokens[:, start:stop], positions[:, start:stop], cache)
        pieces.append(logits)
    full = model.apply(params, tokens)
    got = jnp.concatenate(pieces, axis=1)
    assert got.dtype == jnp.float32 and float(full.std()) > 0.5  # far from uniform
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-5)


def _greedy_reference(model, params, prompt, count):
    """Re-run the full forward on the whole sequence for every new token and take the argmax.
    (Zero-padded to one length, compiled once: causality keeps the padding out of the result.)"""
    apply, ids = jax.jit(model.apply), list(prompt)
    for _ in range(count):
        padded = jnp.asarray([ids + [0] * (len(prompt) + count - len(ids))], jnp.int32)
        ids.append(int(jnp.argmax(apply(params, padded)[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_greedy_equals_argmax_of_the_full_forward(model_and_params):
    model, params = model_and_params
    got = generate(model, params, PROMPT, 6)
    assert got == _greedy_reference(model, params, PROMPT, 6)
    assert len(set(got)) > 1  # not one token over and over


def test_sampling_is_seeded_and_top_k_restricts_it(model_and_params):
    model, params = model_and_params
    sample = generate(model, params, PROMPT, 16, temperature=1.0, top_k=5, seed=3)
    assert sample == generate(model, params, PROMPT, 16, temperature=1.0, top_k=5, seed=3)
    assert sample != generate(model, params, PROMPT, 16, temperature=1.0, top_k=5, seed=4)
    # Every sampled token is among the 5 most likely after the tokens before it.
    logits = model.apply(params, jnp.asarray([PROMPT + sample], jnp.int32))[0, len(PROMPT) - 1:-1]
    top5 = np.argsort(np.asarray(logits), axis=-1)[:, -5:]
    assert all(token in row for token, row in zip(sample, top5))
    assert generate(model, params, PROMPT, 6, temperature=0.7, top_k=1, seed=1) == generate(model, params, PROMPT, 6)


def test_generates_from_sharded_params(model_and_params):
    """Params laid out as a training run on fsdp=4 x tensor=2 holds them give the tokens one device gives."""
    model, params = model_and_params
    layout = make_layout(fsdp=4, tensor=2)
    sharded = jax.device_put(params, shd.named(layout.mesh, param_specs(model, layout, over_data=False)))
    assert len(sharded["embed"].sharding.device_set) == 8
    assert generate(model, sharded, PROMPT, 6) == generate(model, params, PROMPT, 6)


@pytest.mark.parametrize("prompt, kwargs, field", [
    ([], {}, "prompt"),
    ([3, 100], {}, "prompt"),
    (PROMPT, dict(max_new_tokens=-1), "max_new_tokens"),
    (PROMPT, dict(max_new_tokens=26), "max_new_tokens"),  # gpt2: 7 + 26 > max_seq_len 32
    (PROMPT, dict(temperature=-0.5), "temperature"),
    (PROMPT, dict(top_k=101), "top_k"),
])
def test_bad_arguments_name_their_field(prompt, kwargs, field):
    model = LanguageModel(SPECS["gpt2_tied"])
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError) as error:
        generate(model, {}, prompt, **kwargs)  # checked before the parameters are touched
    assert error.value.field == field


def test_llama_has_no_length_limit_but_the_cache():
    model = LanguageModel(SPECS["llama_gqa_untied"])
    assert len(generate(model, model.init(jax.random.PRNGKey(1)), [1, 2], 40)) == 40


PATTERN = "abcdef"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir whose model was trained on 'abcdef' repeated, until it continues the pattern."""
    root = tmp_path_factory.mktemp("generate")
    (root / "pattern.txt").write_text(PATTERN * 2000)
    config = small_config()
    config.data.path = str(root / "pattern.txt")
    config.train.update(steps=60, log_every=10, eval_every=0)
    config.optim.lr = 1e-2
    config.checkpoint.every_steps = 0  # saved once, at the last step
    from jaxscale.runtime.loop import train

    records = train(config, root / "run", show_progress=False)
    assert records[-1]["loss"] < 0.05, records
    return root / "run"


def test_cli_continues_the_pattern(trained):
    result = run_cli([f"--workdir={trained}", "--prompt=cdefab", "--max_new_tokens=13", "--temperature=0"],
                     devices=1, module="jaxscale.generate")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "cdefab" + "cdefabcdefabc" + "\n"
    # Orbax's warnings about the read-only checkpoint it was asked to open are not shown.
    assert "absl" not in result.stderr and "read only" not in result.stderr + result.stdout, result.stderr
    assert result.stderr == ""


def test_cli_takes_a_step_directory_and_samples(trained, capsys):
    step_dir = next(p for p in (trained / "checkpoints").iterdir() if p.name.isdigit())
    assert generate_cli.main([f"--workdir={step_dir}", "--prompt=abc", "--max_new_tokens=9", "--top_k=1"]) == 0
    assert capsys.readouterr().out == "abc" + "defabcdef" + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt="], "--prompt='': missing or empty"),
    (["--prompt=abc", "--top_k=many"], "--top_k='many': expected int"),
    (["--prompt=abc", "--temperature=-1"], "temperature=-1.0: must be >= 0"),
])
def test_cli_bad_input_is_one_line(trained, capsys, args, message):
    assert generate_cli.main([f"--workdir={trained}", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_without_checkpoints_exits_2(tmp_path, capsys):
    assert generate_cli.main([f"--workdir={tmp_path}", "--prompt=abc"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "holds no jaxscale checkpoint" in err, err
