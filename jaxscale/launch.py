"""CLI: python -m jaxscale.launch --nproc N [--devices_per_proc K] [--grace_s S]
                                 [--max_restarts R] [--min_nproc M] -- COMMAND ...

Starts N local processes of COMMAND that join one jax.distributed job (process 0 coordinates on
127.0.0.1 at a free port), for developing and testing multi-host behaviour on one machine.
`--devices_per_proc K` gives each process K fake CPU devices. Every output line is prefixed
with its process index. SIGTERM and SIGINT are passed on to every process, once (each runs in
its own session, so a terminal's Ctrl-C reaches them only through here). When a process fails,
the others get SIGTERM, then SIGKILL after `--grace_s`, and the launcher exits with the failed
process's code. On clusters, start processes with the scheduler (configs/cluster/).

Restarts (`--max_restarts R`, TorchElastic's semantics on one machine): when a process fails,
the others are stopped and the job starts again, up to R times in all, with the processes that
are healthy: a process killed by a signal (SIGKILL: its host is gone) is left out, one that
exited with an error is started again. At least `--min_nproc` (default N) must remain. COMMAND
must resume by itself (`jaxscale.train` does, from the workdir's latest checkpoint; with
`mesh.data=-1` the data axis takes up the new device count). Each restart is logged with the
reason, the last step the job reported and the new process count. A SIGTERM or SIGINT to the
launcher stops the job for good.

Exit codes: 0 every process finished with 0; 2 bad flags; otherwise the first failure's code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

USAGE = ("usage: python -m jaxscale.launch --nproc N [--devices_per_proc K] [--grace_s S] [--max_restarts R] "
         "[--min_nproc M] -- COMMAND ...")
STEP = re.compile(r"^step (\d+) ")


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
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--min_nproc", type=int, default=0)
    flags = parser.parse_args(argv[:split])
    if flags.nproc < 1:
        raise ValueError(f"--nproc={flags.nproc}: give the number of processes (>= 1)")
    if flags.max_restarts < 0:
        raise ValueError(f"--max_restarts={flags.max_restarts}: give how many restarts the job may use (>= 0)")
    flags.min_nproc = flags.min_nproc or flags.nproc
    if not 1 <= flags.min_nproc <= flags.nproc:
        raise ValueError(f"--min_nproc={flags.min_nproc}: give a count between 1 and --nproc={flags.nproc}")
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


def _relay(index: int, stream, lock: threading.Lock, last_step: list) -> None:
    """Copy a child's output to ours, each line prefixed with its index; note the last step line."""
    for line in stream:
        found = STEP.match(line)
        if found:
            last_step[0] = int(found.group(1))
        with lock:
            sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()


class Job:
    """The started processes, their output relays, and stopping them."""

    def __init__(self, command: list[str], nproc: int, devices: int):
        port, lock, self.last_step = _free_port(), threading.Lock(), [None]
        self.procs = [subprocess.Popen(command, env=child_env(i, nproc, port, devices), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
                      for i in range(nproc)]
        self.relays = [threading.Thread(target=_relay, args=(i, p.stdout, lock, self.last_step), daemon=True)
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


def _wait(job: Job, grace_s: float) -> tuple[int, list[int]]:
    """Until every process has exited, or one fails and the others are stopped: (the job's exit
    code, the processes killed by SIGKILL, as a lost host's are, when it failed)."""
    while job.running():
        failed = job.first_failure()
        if failed is not None:
            index, code = failed
            lost = [i for i, p in enumerate(job.procs) if p.poll() == -signal.SIGKILL]
            print(f"jaxscale.launch: process {index} exited with {code}; stopping the others", file=sys.stderr,
                  flush=True)
            job.stop(grace_s)
            return _shell_code(code), lost
        time.sleep(0.05)
    job.stop(grace_s)  # all have exited; joins the relays
    failed = job.first_failure()
    return (0, []) if failed is None else (_shell_code(failed[1]), [])


def _restart_with(nproc: int, lost: list[int], min_nproc: int, restarts: int, max_restarts: int,
                  last_step: int | None) -> int | None:
    """The process count to start again with (logged), or None (logged) when the job stops here."""
    healthy, after = nproc - len(lost), "before any step" if last_step is None else f"after step {last_step}"
    if restarts >= max_restarts:
        if max_restarts:
            print(f"jaxscale.launch: {restarts} of --max_restarts={max_restarts} used; not restarting",
                  file=sys.stderr, flush=True)
        return None
    if healthy < min_nproc:
        print(f"jaxscale.launch: {healthy} healthy processes, fewer than --min_nproc={min_nproc}; not restarting",
              file=sys.stderr, flush=True)
        return None
    reason = f"processes {lost} were killed (lost)" if lost else "a process failed (restarting all)"
    print(f"jaxscale.launch: restart {restarts + 1}/{max_restarts} {after}: {reason}; starting {healthy} processes",
          file=sys.stderr, flush=True)
    return healthy


def run(command: list[str], nproc: int, devices: int, grace_s: float, max_restarts: int = 0,
        min_nproc: int | None = None) -> int:
    """The job, started again after failures as `max_restarts` and `min_nproc` allow; its exit code."""
    current: dict = {"job": None, "stopping": False}

    def forward(signum, frame):
        current["stopping"] = True  # a signal from outside ends the job for good: no restart after it
        if current["job"] is not None:
            current["job"].signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    restarts, min_nproc = 0, min_nproc or nproc
    try:
        while True:
            current["job"] = job = Job(command, nproc, devices)
            # Before a restart the others cannot finish a collective save without the failed one:
            # stop them at once; the new job resumes from the last committed checkpoint.
            code, lost = _wait(job, grace_s if restarts == max_restarts else 0.0)
            if code == 0 or current["stopping"]:
                return code
            nproc = _restart_with(nproc, lost, min_nproc, restarts, max_restarts, job.last_step[0])
            if nproc is None:
                return code
            restarts += 1
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
    return run(command, flags.nproc, flags.devices_per_proc, flags.grace_s, flags.max_restarts, flags.min_nproc)


if __name__ == "__main__":
    sys.exit(main())
