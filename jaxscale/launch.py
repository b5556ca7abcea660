"""CLI: python -m jaxscale.launch --nproc N [--devices_per_proc K] [--grace_s S] -- COMMAND ...

Starts N local processes of COMMAND that join one jax.distributed job (process 0 coordinates on
127.0.0.1 at a free port), for developing and testing multi-host behaviour on one machine.
`--devices_per_proc K` gives each process K fake CPU devices. Every output line is prefixed
with its process index. SIGTERM and SIGINT are passed on to every process, once (each runs in
its own session, so a terminal's Ctrl-C reaches them only through here). When a process fails,
the others get SIGTERM, then SIGKILL after `--grace_s`, and the launcher exits with the failed
process's code. On clusters, start processes with the scheduler (configs/cluster/).

Exit codes: 0 every process finished with 0; 2 bad flags; otherwise the first failure's code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

USAGE = "usage: python -m jaxscale.launch --nproc N [--devices_per_proc K] [--grace_s S] -- COMMAND ..."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, raised, instead of argparse's usage dump and exit
        raise ValueError(f"{message}; {USAGE}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(flags: nproc, devices_per_proc, grace_s; command); ValueError with a one-line message."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise ValueError(f"missing the command after --; {USAGE}")
    split = argv.index("--")
    parser = _Parser(add_help=False)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--devices_per_proc", type=int, default=0)
    parser.add_argument("--grace_s", type=float, default=30.0)
    flags = parser.parse_args(argv[:split])
    if flags.nproc < 1:
        raise ValueError(f"--nproc={flags.nproc}: give the number of processes (>= 1)")
    return flags, argv[split + 1:]


def child_env(index: int, nproc: int, port: int, devices: int, base=None) -> dict:
    """Process `index`'s environment: how to join the job, and its fake devices."""
    env = dict(os.environ if base is None else base, JAXSCALE_COORDINATOR=f"127.0.0.1:{port}",
               JAXSCALE_NUM_PROCESSES=str(nproc), JAXSCALE_PROCESS_ID=str(index), PYTHONUNBUFFERED="1")
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _relay(index: int, stream, lock: threading.Lock) -> None:
    """Copy a child's output to ours, each line prefixed with its index."""
    for line in stream:
        with lock:
            sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()


class Job:
    """The started processes, their output relays, and stopping them."""

    def __init__(self, command: list[str], nproc: int, devices: int):
        port, lock = _free_port(), threading.Lock()
        self.procs = [subprocess.Popen(command, env=child_env(i, nproc, port, devices), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
                      for i in range(nproc)]
        self.relays = [threading.Thread(target=_relay, args=(i, p.stdout, lock), daemon=True)
                       for i, p in enumerate(self.procs)]
        for relay in self.relays:
            relay.start()

    def signal(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def first_failure(self) -> tuple[int, int] | None:
        """(index, exit code) of a process that has failed, if any."""
        return next(((i, p.returncode) for i, p in enumerate(self.procs) if p.poll() not in (None, 0)), None)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the ones still running, SIGKILL whatever is left after `grace_s`."""
        self.signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        while self.running() and time.monotonic() < end:
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for relay in self.relays:
            relay.join(timeout=5)


def _shell_code(returncode: int) -> int:
    """A process killed by signal N reports -N; shells say 128+N."""
    return returncode if returncode > 0 else 128 - returncode


def run(command: list[str], nproc: int, devices: int, grace_s: float) -> int:
    job = Job(command, nproc, devices)
    forward = lambda signum, frame: job.signal(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while job.running():
            failed = job.first_failure()
            if failed is not None:
                index, code = failed
                print(f"jaxscale.launch: process {index} exited with {code}; stopping the others", file=sys.stderr,
                      flush=True)
                job.stop(grace_s)
                return _shell_code(code)
            time.sleep(0.05)
        job.stop(grace_s)  # all have exited; joins the relays
        failed = job.first_failure()
        return 0 if failed is None else _shell_code(failed[1])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        flags, command = parse(argv)
    except ValueError as error:
        print(f"jaxscale.launch: error: {error}", file=sys.stderr)
        return 2
    return run(command, flags.nproc, flags.devices_per_proc, flags.grace_s)


if __name__ == "__main__":
    sys.exit(main())
