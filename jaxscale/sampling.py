"""Text generation with a KV cache: the prompt is prefilled in one call, then one token is decoded
per step inside one jitted loop over a fixed-size cache.

Works on parameters on one device or sharded over a mesh (as the training state holds them):
nothing is moved, JAX propagates the shardings through the loop. One compilation per model,
prompt length, max_new_tokens, top_k, greedy or not and dtype; temperature and seed are traced.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError


def generate(model, params: dict, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, dtype=jnp.float32) -> list[int]:
    """The `max_new_tokens` token ids that follow `prompt_ids` (the prompt not included).

    temperature 0 takes the most likely token each step (greedy); above 0 samples from
    softmax(logits / temperature), among the top_k most likely tokens only when top_k > 0. The
    same seed gives the same tokens. `model` is a LanguageModel, `params` its float32 parameters;
    the forward runs in `dtype`. Bad arguments raise ConfigError.
    """
    prompt = _checked(model.spec, prompt_ids, max_new_tokens, temperature, top_k)
    if max_new_tokens == 0:
        return []
    model = model.unsharded()  # decoding runs one program at any batch size, whatever the training strategy
    ids = _generate(model, params, jnp.asarray(prompt, jnp.int32), jnp.float32(temperature),
                    jax.random.PRNGKey(seed), max_new_tokens=max_new_tokens, top_k=top_k,
                    greedy=temperature == 0, dtype=jnp.dtype(dtype))
    return [int(i) for i in jax.device_get(ids)]


def _checked(spec, prompt_ids, max_new_tokens: int, temperature: float, top_k: int) -> list[int]:
    """The prompt as a list of ints, after checking every argument against the model."""
    prompt = [int(i) for i in prompt_ids]
    vocab = spec.vocab_size
    if not prompt:
        raise ConfigError("prompt", "", "is empty; generation continues a prompt of at least one token")
    outside = [i for i in prompt if not 0 <= i < vocab]
    if outside:
        raise ConfigError("prompt", outside[0], f"token id outside the model's vocabulary (model.vocab_size={vocab}); "
                          "encode the prompt with the tokenizer the model was trained with")
    if max_new_tokens < 0:
        raise ConfigError("max_new_tokens", max_new_tokens, "must be >= 0")
    if temperature < 0:
        raise ConfigError("temperature", temperature, "must be >= 0 (0 = greedy)")
    if not 0 <= top_k <= vocab:
        raise ConfigError("top_k", top_k, f"must be between 0 (every token) and model.vocab_size={vocab}")
    total = len(prompt) + max_new_tokens
    if spec.arch.position == "learned" and total > spec.max_seq_len:
        raise ConfigError("max_new_tokens", max_new_tokens,
                          f"the prompt ({len(prompt)} tokens) and the new tokens make {total}, more than the "
                          f"model.max_seq_len={spec.max_seq_len} learned positions; ask for at most "
                          f"{max(spec.max_seq_len - len(prompt), 0)} new tokens or shorten the prompt")
    return prompt


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k", "greedy", "dtype"))
def _generate(model, params, prompt_L, temperature, key, *, max_new_tokens: int, top_k: int, greedy: bool, dtype):
    """int32 [max_new_tokens]: prefill the prompt, pick a token, then decode and pick one at a time."""
    length = prompt_L.shape[0]
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    cache = model.init_cache(1, length + max_new_tokens, dtype)

    def pick(logits_BLV, i):
        return _pick(logits_BLV[0, -1], temperature, jax.random.fold_in(key, i), top_k, greedy)

    def step(i, carry):
        ids, cache = carry
        logits_BLV, cache = model.decode(params, ids[i - 1].reshape(1, 1), jnp.full((1, 1), length + i - 1), cache)
        return ids.at[i].set(pick(logits_BLV, i)), cache

    logits_BLV, cache = model.decode(params, prompt_L[None], jnp.arange(length)[None], cache)
    ids = jnp.zeros((max_new_tokens,), jnp.int32).at[0].set(pick(logits_BLV, 0))
    return jax.lax.fori_loop(1, max_new_tokens, step, (ids, cache))[0]


def _pick(logits_V, temperature, key, top_k: int, greedy: bool):
    """The next token id: argmax, or a sample at `temperature` from the top_k logits (all if 0)."""
    if greedy:
        return jnp.argmax(logits_V).astype(jnp.int32)
    if top_k:
        kth = jax.lax.top_k(logits_V, top_k)[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(key, logits_V / temperature).astype(jnp.int32)
