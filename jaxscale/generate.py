"""CLI: python -m jaxscale.generate --workdir=DIR --prompt=TEXT [--max_new_tokens=200]
[--temperature=0.8] [--top_k=40] [--seed=0]

Continues the prompt with a checkpoint's model (the newest committed step of a workdir or its
checkpoints/ directory, or one step's directory) and prints the prompt and the continuation,
which stops early at the tokenizer's end-of-text id. --temperature=0 is greedy.

Exit codes: 0 done, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

from jaxscale import cli
from jaxscale.errors import ConfigError

USAGE = ("usage: python -m jaxscale.generate --workdir=DIR --prompt=TEXT [--max_new_tokens=200] "
         "[--temperature=0.8] [--top_k=40] [--seed=0]")
FLAGS = {"workdir": str, "prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int, "seed": int}
DEFAULTS = {"max_new_tokens": 200, "temperature": 0.8, "top_k": 40, "seed": 0}


def _generate(argv: list[str]) -> None:
    flags = {**DEFAULTS, **cli.parse_named(argv, USAGE, FLAGS)}
    for name in ("workdir", "prompt"):
        if not flags.get(name):
            raise ConfigError(f"--{name}", flags.get(name, ""), f"missing or empty; {USAGE}")

    import jax  # after parsing: bad flags fail before JAX starts

    from jaxscale.checkpoint.params import load_params
    from jaxscale.data.tokenize import load_tokenizer
    from jaxscale.models import model_from_config
    from jaxscale.models.precision import compute_dtype
    from jaxscale.sampling import generate

    config, params, _ = load_params(flags["workdir"])
    tokenizer = load_tokenizer(config.data.tokenizer)
    model, _ = model_from_config(config, jax.default_backend())
    ids = generate(model, params, tokenizer.encode(flags["prompt"]), flags["max_new_tokens"], flags["temperature"],
                   flags["top_k"], flags["seed"], compute_dtype(config.model.dtype, jax.default_backend()))
    if tokenizer.eos_id in ids:
        ids = ids[:ids.index(tokenizer.eos_id)]
    print(flags["prompt"] + tokenizer.decode(ids))


def main(argv: list[str] | None = None) -> int:
    return cli.run(_generate, USAGE, argv)


if __name__ == "__main__":
    cli.exit_process(main())
