"""What every benchmark script shares: the --json/--append/--smoke flags, the machine line,
printing on process 0 only, and writing its entry into benchmarks/results/<script>.md: one entry
per configuration (its title), replaced by a new run of the same configuration; git keeps the
history.

Importing this module also puts the repository root first on sys.path, so that
`python benchmarks/X.py` measures the jaxscale next to the script, not whichever checkout an
editable install points at.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def fake_cpu_devices(count: int) -> None:
    """Ask for `count` fake CPU devices (unless JAX_PLATFORMS picks another); before importing jax."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def tiny_config(overrides: list[str]):
    """configs/tiny.py with `a.b=value` overrides (as --config.a.b=value)."""
    from jaxscale import cli

    return cli.load_config(str(ROOT / "configs" / "tiny.py"), overrides)


def add_flags(parser) -> None:
    """The output flags every benchmark takes."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--append", action="store_true",
                        help="write the table into benchmarks/results/SCRIPT.md, replacing this configuration's entry")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiniest run through the whole code path (tests); never writes results")


def size_text(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: '1.5 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.4g} {unit}"
    return f"{nbytes:,.0f} B"


def _host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming the devices, processes, host CPU and jax version."""
    import jax

    kind, backend = jax.devices()[0].device_kind, jax.default_backend()
    kind += f" ({backend})" if backend != kind else ""
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return (f"{jax.device_count()} x {kind}{processes}; "
            f"host {_host_cpu()}, {os.cpu_count()} cores; jax {jax.__version__}")


def accelerator() -> str:
    """', NVIDIA H100 80GB HBM3' on an accelerator, '' on CPU: keeps entries of each machine apart."""
    import jax

    return "" if jax.default_backend() == "cpu" else f", {jax.devices()[0].device_kind}"


def command() -> str:
    """The command line that ran this benchmark, as typed from the repository root."""
    return " ".join(["python"] + [shlex.quote(arg) for arg in sys.argv])


def entry(title: str, body: str) -> str:
    """A results entry: the configuration as its heading, the command, machine and date, then the body."""
    return (f"## {title}\n\n"
            f"`{command()}`; machine: {machine()}; {datetime.date.today()}.\n\n{body}")


def write_entry(path: Path, text: str) -> None:
    """`text` (an `entry`) into the results file at `path`: in place of the entry with the same
    heading, else at the end (a new file starts with the script's name as its title)."""
    heading = text.split("\n", 1)[0]
    old = path.read_text() if path.exists() else f"# {path.stem}\n"
    head, *rest = old.split("\n## ")
    entries = [text if ("## " + e).split("\n", 1)[0] == heading else "## " + e for e in rest]
    if text not in entries:
        entries.append(text)
    path.write_text("\n\n".join([head.rstrip()] + [e.rstrip() for e in entries]) + "\n")


def metadata() -> dict:
    """Date, command and machine, for JSON output."""
    return {"date": str(datetime.date.today()), "command": command(), "machine": machine()}


def report(args, text: str, data: dict) -> None:
    """Print the JSON object (--json) or the text; write the entry with --append (not --smoke).

    Only process 0 prints or writes, so a multi-process run reports once.
    """
    import jax

    if jax.process_index() != 0:
        return
    print(json.dumps({**data, **metadata()}) if args.json else text, flush=True)
    if args.append and args.smoke:
        print("--smoke: not writing results", file=sys.stderr)
    elif args.append:
        write_entry(RESULTS / f"{Path(sys.argv[0]).stem}.md", text)
