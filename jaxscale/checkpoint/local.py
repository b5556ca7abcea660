"""The local checkpoint layer (`checkpoint.local_every_steps`): between Orbax's persistent saves,
each process keeps a copy of its own blocks of the state, and a replica of its ring
predecessor's, in host memory that outlives the process (a RAM disk, /dev/shm by default) or a
local directory (`checkpoint.local_dir`; `{process}` in it becomes the process index: one
directory per process, as when each has its own disk).

Saving blocks the step only while the replica's collective permute runs and the blocks are
copied off the devices; a background thread writes one file per process and step
(LOCAL/<step>/p<i>of<n>.npz, then its .json, so a step's file is complete when its .json
exists) and deletes all but the two newest steps. A restarted job (any process count, any mesh)
exchanges what each process holds, picks the newest step newer than the persistent checkpoint
whose every block some process still holds (its own copy or a peer's replica), and puts the
state back together from those blocks: no persistent storage is read. Copies belong to their
workdir (a token in WORKDIR/local_checkpoints.json: a deleted and recreated workdir does not
pick up an old run's copies) and are deleted once a persistent checkpoint supersedes them.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
import zipfile
from pathlib import Path

import jax
import numpy as np

from jaxscale.checkpoint import blocks
from jaxscale.checkpoint.manager import Restored
from jaxscale.errors import RunError
from jaxscale.runtime.exchange import allgather_json

TOKEN_FILE = "local_checkpoints.json"  # in the workdir: which local copies belong to it
KEEP = 2                               # newest steps kept by each process


def default_directory(workdir: Path) -> Path:
    """A RAM disk where there is one (/dev/shm), else the temp dir; one folder per workdir."""
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    key = hashlib.sha1(str(Path(workdir).absolute()).encode()).hexdigest()[:16]
    return root / f"jaxscale-{getpass.getuser()}" / key


def _token(workdir: Path) -> str:
    """The workdir's token, made by process 0 on first use and told to every process."""
    token = ""
    if jax.process_index() == 0:
        path = Path(workdir) / TOKEN_FILE
        if path.exists():
            token = json.loads(path.read_text())["token"]
        else:
            token = uuid.uuid4().hex
            path.write_text(json.dumps({"token": token}) + "\n")
    return allgather_json(token)[0]


def _leaves(tree) -> tuple[list[str], list]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(path) for path, _ in flat], [leaf for _, leaf in flat]


class LocalCheckpointer:
    """Saves every `checkpoint.local_every_steps` steps; restores the newest complete copy."""

    def __init__(self, workdir: Path, ckpt_cfg, mesh):
        self.every, self.mesh = ckpt_cfg.local_every_steps, mesh
        self.directory = Path(ckpt_cfg.local_dir.format(process=jax.process_index())) if ckpt_cfg.local_dir \
            else default_directory(workdir)
        self.token = _token(workdir)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state, position: dict) -> None:
        """Copy this process's blocks (and its predecessor's) to the host; a thread writes them.
        The state may be donated to the next step as soon as this returns."""
        self.wait()
        names, leaves = _leaves(state)
        arrays = {f"{i}@{block}": blocks.host_bits(values) for i, held in enumerate(self._blocks(leaves))
                  for block, values in held.items()}
        layout = {n: {"shape": list(x.shape), "dtype": str(x.dtype), "blocks": blocks.all_of(x.sharding, x.shape)}
                  for n, x in zip(names, leaves, strict=True)}
        meta = {"step": step, "token": self.token, "position": position, "leaves": layout, "held": sorted(arrays)}
        self._writer = threading.Thread(target=self._write, args=(step, arrays, meta), daemon=True,
                                        name="jaxscale-local-checkpoint")
        self._writer.start()

    def _blocks(self, leaves: list) -> list[dict]:
        """Per leaf, the blocks this process holds: its own, and its predecessor's where that
        process holds blocks this one does not."""
        held = [blocks.held(x) for x in leaves]
        if jax.process_count() == 1:
            return held
        need = [i for i, x in enumerate(leaves) if not blocks.replicated_on_every_process(x.sharding, x.shape)]
        if need:
            sources = blocks.peer_sources(self.mesh)
            for i, copy in zip(need, blocks.peer_copy([leaves[i] for i in need], self.mesh), strict=True):
                held[i] = {**blocks.held(copy, sources), **held[i]}
        return held

    def _write(self, step: int, arrays: dict, meta: dict) -> None:
        try:
            folder = self.directory / str(step)
            folder.mkdir(parents=True, exist_ok=True)
            stem = folder / f"p{jax.process_index()}of{jax.process_count()}"
            with open(f"{stem}.npz.tmp", "wb") as f:
                np.savez(f, **arrays)
            os.replace(f"{stem}.npz.tmp", f"{stem}.npz")
            Path(f"{stem}.json.tmp").write_text(json.dumps(meta))
            os.replace(f"{stem}.json.tmp", f"{stem}.json")
            for old in self._steps()[:-KEEP]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)
        except BaseException as error:  # surfaced by wait() on the training thread
            self._error = error

    def wait(self) -> None:
        """Block until the last save is written; RunError if writing it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RunError(f"the local checkpoint could not be written to {self.directory}: {error} (set "
                           "checkpoint.local_dir to a writable local directory, or checkpoint.local_every_steps=0)")

    # -- what is held ------------------------------------------------------------------------

    def _steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def _files(self, step: int) -> list[dict]:
        """The complete files of a step this process sees that belong to this workdir: meta
        with the path of its arrays."""
        found = []
        for path in sorted((self.directory / str(step)).glob("p*.json")):
            try:
                meta = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("token") == self.token and path.with_suffix(".npz").exists():
                found.append(dict(meta, arrays=str(path.with_suffix(".npz"))))
        return found

    def discard(self, keep) -> None:
        """Delete this process's copies of the steps for which keep(step) is False."""
        self.wait()
        for step in self._steps():
            if not keep(step):
                shutil.rmtree(self.directory / str(step), ignore_errors=True)
        with contextlib.suppress(OSError):  # gone entirely when nothing is left (another process may still write)
            self.directory.rmdir()

    # -- restoring ---------------------------------------------------------------------------

    def restore(self, target, newer_than: int | None, say) -> Restored | None:
        """The newest step after `newer_than` whose every block some process holds (its state on
        the target's shardings and its data position), or None. Every process calls this."""
        floor = -1 if newer_than is None else newer_than
        mine = {step: files for step in self._steps() if step > floor and (files := self._files(step))}
        views = allgather_json({str(step): {"held": sorted({key for f in files for key in f["held"]}),
                                            "meta": {k: files[0][k] for k in ("position", "leaves")}}
                                for step, files in mine.items()})
        wanted = [[n, list(x.shape), str(x.dtype)] for n, x in zip(*_leaves(target), strict=True)]
        for step in sorted({int(s) for view in views for s in view}, reverse=True):
            owner = _owners_if_complete(step, views, wanted, say)
            if owner is None:
                continue
            began = time.perf_counter()
            owned = self._load(mine.get(step, []), owner, len(wanted))
            if not _read_everywhere(step, owned, say):
                continue
            state = _assemble(owned, target)
            say(f"restored step {step} from the local checkpoints of {len(set(owner.values()))} of "
                f"{jax.process_count()} processes in {time.perf_counter() - began:.2f}s (persistent storage not read)")
            return Restored(step, state, _meta_of(views, step)["position"], {}, {})
        return None

    def _load(self, files: list[dict], owner: dict, count: int) -> list[dict] | str:
        """Per leaf, the blocks this process owns, read from its files; or what went wrong."""
        me, owned = jax.process_index(), [{} for _ in range(count)]
        try:
            for f in files:
                with np.load(f["arrays"]) as arrays:
                    for key in (k for k in arrays.files if owner.get(k) == me):
                        i, block = key.split("@", 1)
                        owned[int(i)].setdefault(block, arrays[key])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
            return f"{type(error).__name__}: {error}"[:300]
        return owned


def _meta_of(views: list[dict], step: int) -> dict:
    """A step's layout and data position, from the first process that holds any of it."""
    return next(view[str(step)]["meta"] for view in views if str(step) in view)


def _owners_if_complete(step: int, views: list[dict], wanted: list, say) -> dict[str, int] | None:
    """key -> the lowest process index that holds that block of `step`, if the step holds the
    arrays `wanted` ([name, shape, dtype] each) and some process holds every block; else None."""
    meta = _meta_of(views, step)
    if [[n, info["shape"], info["dtype"]] for n, info in meta["leaves"].items()] != wanted:
        say(f"note: local checkpoint step {step} holds other arrays than this run needs; not used")
        return None
    owner: dict[str, int] = {}
    for process, view in enumerate(views):
        for key in view.get(str(step), {}).get("held", ()):
            owner.setdefault(key, process)
    missing = [key for key in _keys(meta) if key not in owner]
    if missing:
        say(f"note: local checkpoint step {step}: {len(missing)} blocks are held by no process that is left "
            f"(e.g. {missing[0]}); trying an older one")
        return None
    return owner


def _read_everywhere(step: int, owned, say) -> bool:
    """Whether every process read its blocks (`owned` here: the blocks, or what went wrong)."""
    problems = allgather_json(owned if isinstance(owned, str) else "")
    bad = next(((p, why) for p, why in enumerate(problems) if why), None)
    if bad:
        say(f"note: local checkpoint step {step} does not read on process {bad[0]} ({bad[1]}); trying an older one")
    return bad is None


def _assemble(owned: list[dict], target):
    """The state from the blocks every process owns (see blocks.assemble)."""
    leaves = _leaves(target)[1]
    return jax.block_until_ready(jax.tree.unflatten(
        jax.tree.structure(target), [blocks.assemble(x, o) for x, o in zip(leaves, owned, strict=True)]))


def _keys(meta: dict) -> list[str]:
    """Every block of a step's state, as `<leaf index>@<block>` (the .npz keys)."""
    return [f"{i}@{b}" for i, info in enumerate(meta["leaves"].values()) for b in info["blocks"]]
