"""CLI: python -m jaxscale.train --config=configs/tiny.py [--config.a.b=value ...] [--workdir=DIR]

Exit codes: 0 done, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxscale.errors import ConfigError

USAGE = "usage: python -m jaxscale.train --config=PATH [--config.section.key=value ...] [--workdir=DIR]"


def parse_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    """(config path, overrides 'a.b=v', workdir) from absl-style flags."""
    path, overrides, workdir = None, [], None
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "--config":
            path = value
        elif name.startswith("--config."):
            overrides.append(arg[len("--config."):])
        elif name == "--workdir":
            workdir = value
        else:
            raise ConfigError(name, value, f"unknown flag; {USAGE}")
    if not path:
        raise ConfigError("--config", "", f"missing; {USAGE}")
    return path, overrides, workdir


def load_config(argv: list[str]):
    """The config with overrides applied, and the workdir (default runs/<config name>)."""
    from jaxscale import config as config_lib

    path, overrides, workdir = parse_args(argv)
    config = config_lib.load(path)
    config_lib.apply_overrides(config, overrides)
    return config, Path(workdir or Path("runs") / Path(path).stem)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        config, workdir = load_config(argv)
        from jaxscale.loop import train  # after parsing: bad flags fail before jax loads

        train(config, workdir, show_progress=sys.stdout.isatty())
    except ConfigError as error:
        print(f"jaxscale: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
