"""A benchmark side in a process of its own, driven line by line over its stdin and stdout.

The worker calls `serve(commands)`; the driver starts it as `Worker(argv)` and asks it
`worker.ask(name, arg)`, which returns the command's JSON-able answer. Only lines that start with
REPLY are answers: anything else the worker prints (a run's notes) goes on to the driver's stderr.
Neither side imports JAX for this, so a PyTorch worker can stay free of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

REPLY = "bench-worker: "


def serve(commands: dict[str, Callable[[str], object]]) -> None:
    """Answer `name arg` lines from stdin with REPLY + JSON lines until `quit` or end of input;
    `quit` answers which of jax, jaxlib and jaxscale this process imported."""
    _say("ready")
    for line in sys.stdin:
        name, _, arg = line.strip().partition(" ")
        if name == "quit":
            break
        _say(commands[name](arg))
    _say(sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "jaxscale"}))


def _say(value) -> None:
    print(REPLY + json.dumps(value), flush=True)


class Worker:
    """A serving process: `ask` a command, `close` for the modules it imported."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=env if env is not None else os.environ.copy())
        self._read()

    def ask(self, name: str, arg: object = ""):
        self._proc.stdin.write(f"{name} {arg}\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> list[str]:
        """Stop the worker; the modules of jax, jaxlib and jaxscale it had imported."""
        self._proc.stdin.write("quit\n")
        self._proc.stdin.flush()
        imported = self._read()
        self._proc.wait(timeout=120)
        return imported

    def _read(self):
        for line in self._proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            print(line, end="", file=sys.stderr)
        raise RuntimeError(f"benchmark worker {self._proc.args[1:3]} ended with exit code {self._proc.wait()}")
