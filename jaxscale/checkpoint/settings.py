"""The checks on the `checkpoint` settings: save cadence, retention, and the checkpoint a new run
starts from."""

from __future__ import annotations

from pathlib import Path

from jaxscale.errors import require, require_non_negative, require_positive


def check(config) -> None:
    """The `checkpoint` settings are usable; raises ConfigError naming the field."""
    require_positive(config, ("checkpoint.max_to_keep", "checkpoint.preemption_timeout_s"))
    require_non_negative(config, ("checkpoint.every_steps", "checkpoint.every_minutes", "checkpoint.keep_every",
                                  "checkpoint.local_every_steps"))
    check_sources(config.checkpoint)
    check_local_dir(config.checkpoint.local_dir)


def check_local_dir(local_dir: str) -> None:
    """checkpoint.local_dir names a directory; `{process}` is the only placeholder."""
    try:
        local_dir.format(process=0)
    except (KeyError, IndexError, ValueError):
        require(False, "checkpoint.local_dir", local_dir,
                "the only placeholder is {process} (the process index); write a literal brace as {{ or }}")


def check_sources(ckpt) -> None:
    """At most one of resume_from / init_from, and each one given exists ('none' turns resuming off)."""
    require(not (ckpt.init_from and ckpt.resume_from), "checkpoint.init_from", ckpt.init_from,
            f"checkpoint.resume_from={ckpt.resume_from!r} is set too; choose one (resume: state and data "
            "position; init: parameters only)")
    for field in ("resume_from", "init_from"):
        path = ckpt[field]
        if path and not (field == "resume_from" and path == "none"):
            require(Path(path).exists(), f"checkpoint.{field}", path,
                    "no such path; give a workdir, its checkpoints/ dir or one step's dir")
