"""Whole compiled programs kept between starts of `python -m jaxscale.train`: a second identical
start loads its train step and its state initialisation without tracing, lowering or compiling.

JAX's persistent cache (jaxscale.runtime.jax_cache) keys a program on its lowered HLO, so every start
still traces the model and lowers it before it can look; on a laptop that is most of what a
second start of a small model spends. This cache keys a program on what it is built from
instead, and misses (then compiles as usual, through JAX's cache) when any of it differs:

- jaxscale's own source, every .py file of the package as it is on disk;
- the versions of Python, jax, jaxlib, flax and optax, and the backend's platform version;
- JAX's settings (jax.config) and XLA's flags ($XLA_FLAGS, $LIBTPU_INIT_ARGS);
- the devices (id, kind, process), the whole config, and the abstract arguments (tree, shapes,
  dtypes, shardings) of the program.

The source on disk is what runs only in a fresh interpreter that nothing has patched, so the
cache is used where `python -m jaxscale.train` turns it on ($JAXSCALE_PROGRAM_CACHE=1, which a
notebook may set too; 0 turns it off), in single-process jobs, with the compile cache on. It
lives in `programs/` of the compile cache's directory, the newest KEEP programs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import jaxlib
import optax
from jax.experimental import serialize_executable

from jaxscale import config as config_lib
from jaxscale.runtime import jax_cache

ENV = "JAXSCALE_PROGRAM_CACHE"
KEEP = 32
SUBDIR = "programs"
_SOURCE = Path(__file__).parent
counts = {"hits": 0}


def directory() -> Path | None:
    """Where programs are kept, or None when this process may not use the cache."""
    cache = jax.config.jax_compilation_cache_dir
    if os.environ.get(ENV) != "1" or not jax.config.jax_enable_compilation_cache or not cache or "://" in cache:
        return None
    return None if jax.process_count() > 1 else Path(cache) / SUBDIR


def key(name: str, config, devices, *args) -> str | None:
    """The program `name` of the run `config` on `devices` for abstract `args`; None when the
    cache is off for this process."""
    if directory() is None:
        return None
    digest = hashlib.sha256()
    for part in (name, _source_digest(), _versions(devices), _settings(), config_lib.to_json(config),
                 _devices(devices), _abstract(args)):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{name}-{digest.hexdigest()}"


def load_or_compile(cache_key: str | None, lower: Callable[[], jax.stages.Lowered]) -> tuple[jax.stages.Compiled, bool]:
    """(the program, whether it was loaded): loaded from the cache when `cache_key` is there, else
    `lower()` compiled and kept under it. A program that cannot be read back (written by another
    jax, cut short) is compiled again; one that cannot be serialized, or that JAX's cache gave
    instead of a compile (its executable, serialized again, runs without some of its kernels on
    XLA:CPU: "Function ... not found"), is only not kept."""
    path = None if cache_key is None else directory() / f"{cache_key}.pkl"
    if path is not None and path.exists():
        loaded = _load(path)
        if loaded is not None:
            counts["hits"] += 1
            return loaded, True
    before = jax_cache.hits()
    compiled = lower().compile()
    if path is not None and jax_cache.hits() == before:  # compiled here, not loaded by JAX's cache
        _store(path, compiled)
    return compiled, False


def hits() -> int:
    """Programs this process has loaded whole so far."""
    return counts["hits"]


def _load(path: Path):
    try:
        blob, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        compiled = serialize_executable.deserialize_and_load(
            blob, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception:  # noqa: BLE001  (any unreadable entry is a miss, never a failed start)
        return None
    with contextlib.suppress(OSError):  # evicted meanwhile by another process: loaded all the same
        os.utime(path)  # the newest use: kept longest
    return compiled


def _store(path: Path, compiled) -> None:
    try:
        devices = [d.id for d in compiled.runtime_executable().local_devices()]  # in the program's order
        entry = pickle.dumps((*serialize_executable.serialize(compiled), devices))
    except Exception:  # noqa: BLE001  (host offload, constants: programs JAX cannot serialize)
        return
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(entry)
        os.replace(partial, path)  # whole or absent, whoever else writes the same key
        for old in sorted(path.parent.glob("*.pkl"), key=_last_used, reverse=True)[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:  # a full disk or a read-only cache costs the next start its head start, not this run
        with contextlib.suppress(OSError):
            partial.unlink()


def _last_used(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed by another process since the listing
        return 0.0


def _source_digest() -> str:
    """Every .py file of the package, read now (an edited file changes the key at the next start)."""
    digest = hashlib.sha256()
    for file in sorted(_SOURCE.rglob("*.py")):
        digest.update(str(file.relative_to(_SOURCE)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _versions(devices) -> str:
    return repr((sys.version, jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__,
                 devices[0].client.platform_version))


def _settings() -> str:
    values = sorted((name, repr(value)) for name, value in jax.config.values.items())
    return repr((values, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")))


def _devices(devices) -> str:
    return repr([(d.id, d.platform, d.device_kind, d.process_index) for d in devices])


def _abstract(args) -> str:
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [(x.shape, str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]))
