"""JAX's persistent compilation cache, on by default: a second start of the same run loads its
compiled programs from disk instead of compiling them again.

The directory: `xla.compile_cache_dir`, else one the user already gave JAX
(JAX_COMPILATION_CACHE_DIR, or jax.config in a notebook), else $JAXSCALE_COMPILE_CACHE_DIR, else
$XDG_CACHE_HOME/jaxscale/xla (~/.cache/jaxscale/xla). `xla.compile_cache=False` (or the directory
`off`) turns caching off for the process. Every program is cached, however quickly it compiled:
on a laptop the small ones add up. JAX keys each entry on the program, the devices, the flags and
the jax version, so a changed model or mesh compiles afresh. `python -m jaxscale.train` also keeps
its train step and initialisation whole in `programs/` there (jaxscale.runtime.program_cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax import monitoring

ENV = "JAXSCALE_COMPILE_CACHE_DIR"
OFF = "off"
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
counts = {_HIT: 0, _MISS: 0}


def _count(event: str, **_) -> None:
    if event in counts:
        counts[event] += 1


monitoring.register_event_listener(_count)


def default_dir(env=None) -> str:
    """$JAXSCALE_COMPILE_CACHE_DIR, else the user's cache directory."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]
    return str(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxscale" / "xla")


def enable(xla_cfg, env=None) -> str | None:
    """Point JAX's persistent cache at the run's directory (or turn it off); a one-line note."""
    directory = xla_cfg.compile_cache_dir if xla_cfg.compile_cache else OFF
    if not directory and jax.config.jax_compilation_cache_dir:  # the user's own, given to JAX: theirs wins
        return f"compiled programs cached in {jax.config.jax_compilation_cache_dir} (JAX's setting)"
    directory = directory or default_dir(env)
    if directory == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in (os.environ if env is None else env):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return f"compiled programs cached in {directory} (xla.compile_cache=False turns it off)"


def hits() -> int:
    """Programs this process has loaded from the persistent cache so far."""
    return counts[_HIT]
