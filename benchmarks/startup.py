"""Time to first step of `python -m jaxscale.train`: a first start, then a second identical one
that finds its programs in the caches (jaxscale.runtime.program_cache, JAX's persistent compilation cache).

    python benchmarks/startup.py [--config=configs/tiny.py] [--repeats=3] [--json] [--append] [--smoke]

Each repeat starts the same two-step run twice on one fake CPU device with a fresh cache directory
(`--config.xla.compile_cache_dir`) and a fresh workdir: from launching the process to the line
of step 1 on its output, the interpreter's imports included. Medians over repeats, and the
seconds each start reported for its train step ("compiled ... in" against "loaded ... in").
Python writes its bytecode as it does by default (a PYTHONDONTWRITEBYTECODE of the caller is
dropped), and a start before the first repeat writes it: no measured start compiles Python.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_LINE = re.compile(r"(compiled|loaded) the (?:compiled |whole )?train step (?:from the cache )?in ([\d.]+)s")


def start(config: str, workdir: Path, cache: Path, extra: list[str]) -> dict:
    """One start: seconds to the step 1 line, from launch and from the run's summary line (printed
    once the interpreter has imported everything, built the run and found the data), and the train
    step's compile (or load) seconds."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")
    for name in ("JAX_COMPILATION_CACHE_DIR", "PYTHONDONTWRITEBYTECODE", "JAXSCALE_PROGRAM_CACHE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "jaxscale.train", f"--config={config}", "--config.train.steps=2",
               "--config.train.eval_every=0", "--config.tracking.report=False", f"--workdir={workdir}",
               f"--config.xla.compile_cache_dir={cache}", *extra]
    began, first, summary, step_s, loaded = time.perf_counter(), None, None, None, False
    with subprocess.Popen(command, cwd=_common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as process:
        for line in process.stdout:
            found = STEP_LINE.search(line)
            if found:
                step_s, loaded = float(found.group(2)), found.group(1) == "loaded"
            if summary is None and " params | mesh " in line:
                summary = time.perf_counter() - began
            if first is None and line.startswith("step 1 "):
                first = time.perf_counter() - began
    if first is None or process.returncode:
        raise SystemExit(f"the run failed: {' '.join(command)}")
    return {"first_step_s": first, "after_summary_s": first - summary, "train_step_s": step_s, "from_cache": loaded}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--repeats", type=int, default=3)
    _common.add_flags(parser)
    args = parser.parse_args(argv)
    extra, repeats = (["--config.model.num_layers=1"], 1) if args.smoke else ([], args.repeats)
    runs = {"first": [], "second": []}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.smoke:
            start(args.config, Path(tmp) / "bytecode", Path(tmp) / "bytecode-cache", extra)
        for r in range(repeats):
            cache = Path(tmp) / f"cache{r}"
            for name in runs:
                runs[name].append(start(args.config, Path(tmp) / f"{name}{r}", cache, extra))
    keys = ("first_step_s", "after_summary_s", "train_step_s")
    median = {name: {key: statistics.median(x[key] for x in rows) for key in keys}
              for name, rows in runs.items()}
    result = {"benchmark": "startup", "config": args.config, "repeats": repeats, "runs": runs, "median": median,
              "ratio": median["second"]["first_step_s"] / median["first"]["first_step_s"],
              "ratio_after_summary": median["second"]["after_summary_s"] / median["first"]["after_summary_s"]}
    first, second = median["first"], median["second"]
    text = _common.entry(f"Time to first step, `{args.config}`, a first and a second start", "\n".join([
        "| start | launch to step 1 | summary line to step 1 | train step compiled / loaded |", "|---|---|---|---|",
        f"| first (empty cache) | {first['first_step_s']:.2f} s | {first['after_summary_s']:.2f} s "
        f"| {first['train_step_s']:.2f} s compiled |",
        f"| second (same command) | {second['first_step_s']:.2f} s | {second['after_summary_s']:.2f} s "
        f"| {second['train_step_s']:.2f} s loaded |",
        "", f"ratio second / first: **{result['ratio']:.2f}** from launch, **{result['ratio_after_summary']:.2f}** "
        f"from the summary line (medians of {repeats}). Launch to the summary line is the interpreter, its "
        "imports, building the run and finding the data: no cache shortens it."]))
    _common.report(args, text, result)


if __name__ == "__main__":
    main()
