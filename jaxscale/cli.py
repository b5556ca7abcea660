"""What every jaxscale command line shares: absl-style config flags and exit codes.

Exit codes: 0 done (also after a preemption checkpoint), 2 bad input (one line on stderr),
1 anything else (a RunError is one line too).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from jaxscale.errors import ConfigError, PreflightError, RunError


def parse_flags(argv: list[str], usage: str, extra: dict[str, type]) -> tuple[str, list[str], dict]:
    """(config path, overrides 'a.b=v', {extra flag: value}); a bare --flag means True."""
    path, overrides, rest = None, [], []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "--config":
            path = value
        elif name.startswith("--config."):
            overrides.append(arg[len("--config."):])
        else:
            rest.append(arg)
    values = parse_named(rest, usage, extra)
    if not path:
        raise ConfigError("--config", "", f"missing; {usage}")
    return path, overrides, values


def parse_named(argv: list[str], usage: str, flags: dict[str, type]) -> dict:
    """{flag: value} of --flag=value arguments, converted to their types; a bare --flag means True."""
    values = {}
    for arg in argv:
        name, sep, value = arg.partition("=")
        if not name.startswith("--") or name[2:] not in flags:
            raise ConfigError(name, value, f"unknown flag; {usage}")
        values[name[2:]] = _convert(name, value if sep else "true", flags[name[2:]])
    return values


def _convert(name: str, text: str, kind: type):
    if kind is bool:
        from jaxscale.config import parse_bool

        if (value := parse_bool(text)) is not None:
            return value
    else:
        try:
            return kind(text)
        except ValueError:
            pass
    raise ConfigError(name, text, f"expected {kind.__name__}")


def load_config(path: str, overrides: list[str]):
    """The config file's get_config() with overrides applied."""
    from jaxscale import config as config_lib

    config = config_lib.load(path)
    config_lib.apply_overrides(config, overrides)
    return config


def _exit_code(call: Callable[[], None]) -> int:
    """Run `call`; its exit code, with bad input and run errors as one line on stderr."""
    try:
        call()
    except ConfigError as error:
        print(f"jaxscale: error: {error}", file=sys.stderr)
        return 2
    except PreflightError as error:
        print(f"jaxscale: error: {error}", file=sys.stderr)
        return 3
    except RunError as error:
        print(f"jaxscale: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the training steps, which save and exit 0 on SIGINT
        print("jaxscale: interrupted", file=sys.stderr)
        return 130
    return 0


def run(body: Callable[[list[str]], None], usage: str, argv: list[str] | None = None) -> int:
    """Run `body(argv)` as a command: -h/--help prints usage; a ConfigError exits 2 and a RunError
    1, each as one line on stderr; Ctrl-C exits 130."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        return 0
    return _exit_code(lambda: body(argv))


def exit_process(code: int) -> NoReturn:
    """A command's last act: exit with `code`. Once JAX has started, the interpreter's teardown
    is skipped (runtime/distributed.leave says why)."""
    if "jax" in sys.modules:
        from jaxscale.runtime import distributed

        distributed.leave(code)
    sys.exit(code)


def main(command: Callable[[object, str, dict], None], usage: str, extra: dict[str, type],
         argv: list[str] | None = None) -> int:
    """Parse flags, load the config, run `command(config, path, flags)`; bad input exits 2."""
    def body(argv: list[str]) -> None:
        path, overrides, flags = parse_flags(argv, usage, extra)
        command(load_config(path, overrides), path, flags)

    return run(body, usage, argv)
