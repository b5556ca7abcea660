"""How long a checkpoint save blocks the training loop: asynchronous against synchronous, local
(host memory) against persistent, and restore from each.

    python benchmarks/checkpoint.py [--config=configs/tiny.py] [--override=a.b=v ...] [--repeats=5]
        [--json] [--append] [--smoke]

On CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives it N devices.

The state is a real TrainState (parameters and Adam moments) of the config's model, by default
widened to about 230 MB. First, once:
  first   the time the first save of the process blocks: what the first save of a run costs the
          loop, Orbax's first save and the digest program's compile (jaxscale does it in the
          background) included; the commit is then awaited, untimed.
Then each repeat, interleaved so machine noise hits all three:
  async   the time jaxscale's Checkpointer.save blocks (digests of every array, the copy off the
          devices, the start of the background write); the commit is then awaited, untimed;
  sync    save and wait for the commit: what a synchronous checkpoint costs the loop;
  restore the newest step read back onto the same shardings, digests verified;
  local   the time the local checkpoint layer's save blocks (checkpoint.local_every_steps: the
          blocks copied to the host; one process here, so no peer replica is sent);
  local written  that save until its file is in the local directory (the default: /dev/shm);
  local restore  the state put back together from the local copy.
blocking_ratio = median async / median sync (lower is better; 0.1 means the loop waits a tenth).
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxscale import config as config_lib
from jaxscale.build import build
from jaxscale.checkpoint import Checkpointer, LocalCheckpointer

# About 19M parameters: 230 MB of float32 parameters and Adam moments.
WIDE = ["model.d_model=768", "model.d_ff=3072", "model.num_layers=2", "model.num_heads=12", "model.num_kv_heads=12"]
SMOKE = ["model.d_model=64", "model.d_ff=128", "model.num_layers=1"]


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(config, repeats: int, workdir: Path) -> dict:
    config.checkpoint.update(every_steps=0, max_to_keep=2, local_every_steps=1, local_dir="")
    run = build(config)
    state = run.init_state()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    times = {key: [] for key in ("async", "sync", "restore", "local", "local_written", "local_restore")}
    meta = {"benchmark": True}
    jax.block_until_ready(state)  # time the save, not the state's initialisation
    local = LocalCheckpointer(workdir, config.checkpoint, run.layout.mesh)
    with Checkpointer(workdir / "checkpoints", config.checkpoint) as checkpointer:
        step = 1
        first = _timed(lambda: checkpointer.save(step, state, {}, meta, {}))
        checkpointer.wait()
        for _ in range(repeats):
            step += 1
            times["async"].append(_timed(lambda step=step: checkpointer.save(step, state, {}, meta, {})))
            checkpointer.wait()
            step += 1
            times["sync"].append(_timed(lambda step=step: (checkpointer.save(step, state, {}, meta, {}),
                                                           checkpointer.wait())))
            times["restore"].append(_timed(lambda: jax.block_until_ready(checkpointer.restore(state).state)))
            times["local"].append(_timed(lambda step=step: local.save(step, state, {})))
            times["local_written"].append(times["local"][-1] + _timed(local.wait))
            times["local_restore"].append(_timed(lambda: local.restore(target, None, lambda line: None)))
    local.discard(keep=lambda step: False)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {"state_bytes": _state_bytes(state), "devices": jax.device_count(), "repeats": repeats,
            "first_save_s": first, "async_blocking_s": medians["async"], "sync_save_s": medians["sync"],
            "restore_s": medians["restore"], "blocking_ratio": medians["async"] / medians["sync"],
            "local_blocking_s": medians["local"], "local_written_s": medians["local_written"],
            "local_restore_s": medians["local_restore"], "samples": times}


def report(result: dict) -> str:
    size = result["state_bytes"]
    rows = [("first save of the process, once (loop blocked)", result["first_save_s"]),
            ("async save (loop blocked)", result["async_blocking_s"]),
            ("sync save (loop blocked)", result["sync_save_s"]), ("restore, digests verified", result["restore_s"]),
            ("local save (loop blocked)", result["local_blocking_s"]),
            ("local save, until written", result["local_written_s"]), ("local restore", result["local_restore_s"])]
    title = f"checkpoint: {_common.size_text(size)} TrainState on {result['devices']} devices{_common.accelerator()}"
    return _common.entry(title, "\n".join(
        ["| operation | median time | throughput |", "|---|---|---|"]
        + [f"| {name} | {seconds * 1e3:,.0f} ms | {size / seconds / 2**20:,.0f} MiB/s |" for name, seconds in rows]
        + ["", f"blocking ratio async/sync: **{result['blocking_ratio']:.3f}** (median of {result['repeats']} "
           "interleaved repeats)."]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b")
    parser.add_argument("--repeats", type=int, default=5)
    _common.add_flags(parser)
    args = parser.parse_args()
    overrides = (SMOKE if args.smoke else WIDE) + args.override
    repeats = 1 if args.smoke else args.repeats
    config = config_lib.load(args.config)
    config_lib.apply_overrides(config, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(config, repeats, Path(workdir))
    _common.report(args, report(result), {"benchmark": "checkpoint", "config": args.config, "overrides": overrides,
                                          **result})


if __name__ == "__main__":
    main()
