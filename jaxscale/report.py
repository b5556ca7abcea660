"""CLI: python -m jaxscale.report --workdir=DIR [--compare OTHER_DIR ...]

A run's report, in its workdir: loss.png (loss and val_loss against step and tokens), lr.png,
grad_norm.png, throughput.png (tokens/s and MFU) and report.md (config summary, mesh and
sharding, final numbers, time per phase). Training writes it at the end and refreshes it at
evaluations (tracking.report_every_minutes); this command draws it for any run, and with
--compare overlays the other runs on the plots.
Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from jaxscale.errors import ConfigError

SHARDING = "sharding.txt"  # written by the training loop when a run starts


@dataclasses.dataclass
class RunRecords:
    name: str
    records: list[dict]   # the latest record of each logged step, by step
    config: dict

    def column(self, key: str) -> tuple[list, list]:
        """(steps, values) where the key has a number."""
        pairs = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def read_run(workdir: str | Path) -> RunRecords:
    workdir = Path(workdir)
    metrics = workdir / "metrics.jsonl"
    if not metrics.exists():
        raise ConfigError("--workdir", str(workdir), "has no metrics.jsonl: give the workdir of a run")
    by_step = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    config_file = workdir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    return RunRecords(workdir.name, [by_step[s] for s in sorted(by_step)], config)


# -- plots ---------------------------------------------------------------------------------------

def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * panels, 3.6), layout="constrained")
    FigureCanvasAgg(figure)  # draws to PNG without touching pyplot's (a notebook's) backend
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _tokens_per_step(run: RunRecords) -> float:
    first = next((r for r in run.records if r.get("tokens") and r["step"]), None)
    return first["tokens"] / first["step"] if first else math.nan


def _plot_loss(runs: list[RunRecords], path: Path) -> None:
    figure, (by_step, by_tokens) = _figure(2)
    for run in runs:
        label = run.name if len(runs) > 1 else "loss"
        steps, loss = run.column("loss")
        by_step.plot(steps, loss, label=label)
        by_tokens.plot([s * _tokens_per_step(run) for s in steps], loss, label=label)
        val_steps, val = run.column("val_loss")
        if val:
            by_step.plot(val_steps, val, "o--", label=f"{run.name} val" if len(runs) > 1 else "val_loss")
            by_tokens.plot([s * _tokens_per_step(run) for s in val_steps], val, "o--")
    by_step.set(xlabel="step", ylabel="cross entropy (nats)", title="loss")
    by_tokens.set(xlabel="tokens", title="loss against tokens seen")
    by_step.legend()
    figure.savefig(path, dpi=110)


def _plot_series(runs: list[RunRecords], keys: list[tuple[str, str]], path: Path) -> None:
    figure, axes = _figure(len(keys))
    for axis, (key, title) in zip(axes, keys):
        for run in runs:
            steps, values = run.column(key)
            axis.plot(steps, values, label=run.name)
        axis.set(xlabel="step", title=title)
        if len(runs) > 1:
            axis.legend()
    figure.savefig(path, dpi=110)


PLOTS = ("loss.png", "lr.png", "grad_norm.png", "throughput.png")


def plot(runs: list[RunRecords], out: Path) -> list[Path]:
    paths = [out / name for name in PLOTS]
    _plot_loss(runs, paths[0])
    _plot_series(runs, [("lr", "learning rate")], paths[1])
    _plot_series(runs, [("grad_norm", "gradient norm (before clipping)")], paths[2])
    has_mfu = any(run.column("mfu")[1] for run in runs)
    _plot_series(runs, [("tokens_per_sec", "tokens/s")] + ([("mfu", "MFU")] if has_mfu else []), paths[3])
    return paths


# -- report.md -----------------------------------------------------------------------------------

def _summary(config: dict) -> list[str]:
    if not config:
        return ["(no config.json)"]
    m, t, o = config["model"], config["train"], config["optim"]
    mesh = " ".join(f"{k}={v}" for k, v in config["mesh"].items() if v not in (1,)) or "1 device"
    return [f"- model: {m['family']}, {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads "
            f"({m['num_kv_heads']} kv), d_ff {m['d_ff']}, vocab {m['vocab_size']}, compute {m['dtype']}, "
            f"remat {m['remat']}",
            f"- mesh: {mesh}, zero_stage {config['zero_stage']}",
            f"- training: {t['steps']} steps, batch {t['global_batch_size']} x {t['seq_len']} tokens, "
            f"lr {o['lr']} (warmup {o['warmup_steps']}), weight decay {o['weight_decay']}, clip {o['clip_norm']}",
            f"- data: {config['data']['source']} {config['data']['path'] or ''} ({config['data']['tokenizer']} tokens)"]


def _final(run: RunRecords) -> list[str]:
    last = run.records[-1]
    recent = [r["tokens_per_sec"] for r in run.records[-10:]]
    val = next((r["val_loss"] for r in reversed(run.records) if "val_loss" in r), None)
    mfu = last.get("mfu")
    return [f"- step {last['step']}: loss {last['loss']:.4f}" + (f", val_loss {val:.4f}" if val is not None else ""),
            f"- tokens seen: {last['tokens']:,}",
            f"- throughput: {statistics.median(recent):,.0f} tokens/s (median of the last {len(recent)} logged steps)"
            + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ", MFU n/a (no known peak for this device)")]


def _phases(run: RunRecords) -> list[str]:
    """Sums over logged intervals (each record averages the steps since the previous one)."""
    totals, previous = {"step_time_s": 0.0, "data_wait_s": 0.0, "checkpoint_block_s": 0.0}, 0
    for r in run.records:
        steps = r["step"] - previous if r["step"] > previous else 1
        previous = r["step"]
        for key in totals:
            totals[key] += steps * r.get(key, 0.0)
    last = run.records[-1]
    lines = [f"- training steps: {totals['step_time_s']:,.1f} s, of which waiting for data "
             f"{totals['data_wait_s']:,.1f} s and blocked by checkpoint saves {totals['checkpoint_block_s']:,.1f} s"]
    if "compile_s" in last:
        lines.append(f"- compiling the step: {last['compile_s']:,.1f} s (this session)")
    if "goodput" in last:
        lines.append(f"- goodput: {100 * last['goodput']:.1f}% of this session's wall time went to device steps")
    return lines


def markdown(run: RunRecords, workdir: Path, others: list[RunRecords]) -> str:
    parts = [f"# Run report: {run.name}", "", *_summary(run.config), "", "## Final numbers", "", *_final(run),
             "", "## Time", "", *_phases(run), "", "## Plots", ""]
    parts += [f"![{name[:-4]}]({name})" for name in PLOTS]
    sharding = workdir / SHARDING
    if sharding.exists():
        parts += ["", "## Mesh and sharding", "", "```", sharding.read_text().rstrip(), "```"]
    if others:
        parts += ["", "## Compared runs", "", "| run | last step | loss | val_loss |", "|---|---|---|---|"]
        for other in [run, *others]:
            last = other.records[-1]
            val = next((r["val_loss"] for r in reversed(other.records) if "val_loss" in r), None)
            parts.append(f"| {other.name} | {last['step']} | {last['loss']:.4f} | "
                         f"{'' if val is None else f'{val:.4f}'} |")
    return "\n".join(parts) + "\n"


def write(workdir: str | Path, compare: list[str | Path] = ()) -> list[Path]:
    """Draw the report of the run in `workdir` (overlaying `compare` runs); returns the files."""
    workdir = Path(workdir)
    run, others = read_run(workdir), [read_run(other) for other in compare]
    if not run.records:
        return []
    paths = plot([run, *others], workdir)
    (workdir / "report.md").write_text(markdown(run, workdir, others))
    return [workdir / "report.md", *paths]


USAGE = "usage: python -m jaxscale.report --workdir=DIR [--compare DIR ...]"


def main(argv: list[str] | None = None) -> int:
    from jaxscale import cli

    def command(argv: list[str]) -> None:
        workdir, compare = _parse(argv)
        for path in write(workdir, compare):
            print(path)

    argv = sys.argv[1:] if argv is None else argv
    return cli.run(command, USAGE, argv or ["--help"])


def _parse(argv: list[str]) -> tuple[str, list[str]]:
    workdir, compare, rest = None, [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--workdir="):
            workdir = arg.split("=", 1)[1]
        elif arg == "--compare":
            while rest and not rest[0].startswith("--"):
                compare.append(rest.pop(0))
        elif arg.startswith("--compare="):
            compare.append(arg.split("=", 1)[1])
        else:
            raise ConfigError("flag", arg, USAGE)
    if not workdir:
        raise ConfigError("--workdir", "", f"missing; {USAGE}")
    return workdir, compare


if __name__ == "__main__":
    sys.exit(main())
