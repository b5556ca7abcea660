"""One run per workdir: process 0 holds an exclusive lock on WORKDIR/.lock while the run lives.

The lock is an flock, so the kernel drops it when the process dies (even by SIGKILL): a crashed
run never leaves a stale lock behind. A second run on the same workdir refuses to start rather
than have two writers interleave checkpoints and metrics.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.errors import ConfigError

LOCK = ".lock"


class WorkdirLock:
    """Context manager: creates the workdir and holds its lock; ConfigError if another run has it."""

    def __init__(self, workdir: Path):
        self.workdir, self._file = Path(workdir), None

    def __enter__(self) -> WorkdirLock:
        holder = self._acquire() if jax.process_index() == 0 else ""
        refused = bool(holder)
        if jax.process_count() > 1:  # every process learns process 0's answer
            refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refused)))
        if refused:
            raise ConfigError("--workdir", str(self.workdir), f"is in use by another run{holder}; wait for it "
                              "to finish or stop it, or choose another --workdir")
        return self

    def _acquire(self) -> str:
        """'' when locked by us, else a description of the holder."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        handle = open(self.workdir / LOCK, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            return f" ({holder or 'holder unknown'})"
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
        handle.flush()
        self._file = handle
        return ""

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
