"""Where a checkpoint lives, from what a user types: a workdir, its checkpoints/ directory, or
one step's directory inside it."""

from __future__ import annotations

from pathlib import Path

from jaxscale.errors import ConfigError

CHECKPOINTS = "checkpoints"


def _is_step_dir(path: Path) -> bool:
    return path.name.isdigit() and (path / "state").is_dir()


def locate(path: str, field: str) -> tuple[Path, int | None]:
    """(checkpoints directory, step, or None for its latest committed step)."""
    where = Path(path)
    if (where / CHECKPOINTS).is_dir():
        return where / CHECKPOINTS, None
    if _is_step_dir(where):
        return where.parent, int(where.name)
    if where.is_dir() and any(_is_step_dir(child) for child in where.iterdir()):
        return where, None
    raise ConfigError(field, path, "holds no jaxscale checkpoint; give a workdir, its checkpoints/ directory "
                      "or one step's directory (checkpoints/N)")
