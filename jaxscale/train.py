"""CLI: python -m jaxscale.train --config=configs/tiny.py [--config.a.b=value ...] [--workdir=DIR]

Exit codes: 0 done, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jaxscale import cli

USAGE = "usage: python -m jaxscale.train --config=PATH [--config.section.key=value ...] [--workdir=DIR]"


def _train(config, path: str, flags: dict) -> None:
    # imported after parsing: bad flags fail before the model is built
    from jaxscale.runtime import cpu_malloc, distributed, xla_flags
    from jaxscale.runtime.loop import train

    xla_flags.apply_gpu_defaults(config.xla)  # before JAX starts the GPU backend
    cpu_malloc.apply_cpu_defaults(config.xla)  # before JAX starts its CPU threads
    distributed.initialize(config.distributed)  # before anything touches the devices
    workdir = Path(flags.get("workdir") or Path("runs") / Path(path).stem)
    train(config, workdir, show_progress=sys.stdout.isatty())


def main(argv: list[str] | None = None) -> int:
    return cli.main(_train, USAGE, {"workdir": str}, argv)


if __name__ == "__main__":
    # A fresh interpreter running jaxscale as it is on disk: whole programs may be kept (runtime/program_cache.py).
    os.environ.setdefault("JAXSCALE_PROGRAM_CACHE", "1")
    cli.exit_process(main())
