"""The console view of a run on process 0: a rich progress bar with ETA and one line per log step."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def format_record(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "reward_accuracy" in record:  # preference tuning (jaxscale.preference)
        parts.append(f"reward acc {record['reward_accuracy']:.2f} margin {record['reward_margin']:.3f}")
    parts.append(f"{record['tokens_per_sec']:,.0f} tok/s")
    parts.append(f"step {record['step_time_s'] * 1e3:.1f} ms")
    parts.append("MFU n/a" if record["mfu"] is None else f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


class ProgressDisplay:
    """Progress bar (step, loss, tokens/s, MFU, ETA) plus a printed line per logged step.

    `enabled` (process 0) prints messages: notes, warnings, resume and preemption lines;
    `show_steps` adds the per-step lines and, with `show_bar`, the bar.
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool, show_bar: bool = True,
                 show_steps: bool = True):
        self.enabled, self.show_steps = enabled, enabled and show_steps
        self.console = Console(stderr=False, highlight=False)
        self._bar = None
        if self.show_steps and show_bar:
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False, soft_wrap=True)

    def update(self, record: dict) -> None:
        if not self.show_steps:
            return
        self.print(format_record(record))
        if self._bar is not None:
            mfu = "" if record["mfu"] is None else f" MFU {100 * record['mfu']:.1f}%"
            info = f"loss {record['loss']:.3f} {record['tokens_per_sec']:,.0f} tok/s{mfu}"
            self._bar.update(self._task, completed=record["step"], info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
