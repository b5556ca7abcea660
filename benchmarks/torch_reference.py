"""jaxscale's train step against the same model, batch and optimizer written in PyTorch, on one CPU device.

    python benchmarks/torch_reference.py [--shapes=tiny,gpt2] [--rounds=15] [--steps=10] [--warmup=60]
        [--override=a.b=v ...] [--torch_in_process] [--json] [--append] [--smoke]

Shapes: `tiny` is configs/tiny.py (Llama-style: RMSNorm, RoPE, grouped-query attention, SwiGLU,
tied embeddings; batch 16 x 128); `gpt2` is nanoGPT's CPU example (4 layers, width 128, 4 heads,
MLP 512, LayerNorm with biases, learned positions, tanh GELU, byte vocabulary, batch 12 x 64).
The PyTorch side (benchmarks/_torch_side.py) is written as a well-kept PyTorch script would: one
module per layer, F.scaled_dot_product_attention (causal, GQA), F.cross_entropy,
clip_grad_norm_, torch.optim.AdamW (foreach) with the same decay mask and learning rates; eager
mode, torch's default threads. It starts from jaxscale's initial parameters and takes jaxscale's
batches (handed over in a file), so the first two losses must agree (checked): the two sides
compute the same thing. jaxscale runs its compiled train step (metrics, clipping, guard
included) on its own data pipeline.

Each side runs in a fresh process of its own: PyTorch's never imports JAX or jaxscale (checked,
reported as torch_process_imported), so neither runtime's threads, heap or malloc settings slow
the other. This driver imports neither until it reports. Rounds alternate between the two
processes, `--steps` steps each, after `--warmup` steps of each (steady state: in its first tens
of steps jaxscale's heap still grows, jaxscale/runtime/cpu_malloc.py); medians over rounds, ratio
jaxscale / torch. `--torch_in_process` adds a third column: PyTorch's step inside the jaxscale
process, as it runs beside JAX.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _worker
import numpy as np

SHAPES = {
    "tiny": [],
    "gpt2": ["model.family=gpt2", "model.num_layers=4", "model.d_model=128", "model.num_heads=4",
             "model.num_kv_heads=4", "model.d_ff=512", "model.vocab_size=256", "train.seq_len=64",
             "train.global_batch_size=12"],
}
SMOKE = ["model.num_layers=1", "train.global_batch_size=4", "train.seq_len=32"]
SPEC = ("family", "num_layers", "d_model", "num_heads", "rope_theta", "norm_eps")  # what the PyTorch model reads
OPTIM = ("lr", "b1", "b2", "eps", "weight_decay", "clip_norm")


def hand_over(run, state, directory: Path, steps: int) -> None:
    """What the PyTorch side (benchmarks/_torch_side.py) starts from: the run's initial parameters,
    its first 8 training batches, its model and optimizer settings, its learning rates for `steps`."""
    import jax

    from jaxscale.data import make_data
    from jaxscale.optim import make_schedule

    config, spec = run.config, run.model.spec
    same = make_data(config, run.batch_sharding).train_batches(0)
    held = [jax.device_get(next(same)) for _ in range(8)]
    params = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    arrays = {"param/" + "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in params}
    arrays.update({key: np.stack([np.asarray(b[key]) for b in held]) for key in ("inputs", "targets")})
    np.savez(directory / "arrays.npz", **arrays)
    schedule = make_schedule(config.optim, config.train.steps)
    meta = {"spec": {k: getattr(spec, k) for k in SPEC}, "optim": {k: config.optim[k] for k in OPTIM},
            "lrs": [float(schedule(i)) for i in range(steps)]}
    (directory / "meta.json").write_text(json.dumps(meta))


def jaxscale_side(overrides: list[str], handover: Path, steps: int, torch_too: bool) -> None:
    """Serve the compiled train step (`loss`, `time N`) after writing the handover; with
    `torch_too`, PyTorch's step in this same process too (`torch_loss`, `torch_time N`)."""
    import jax

    import _steps

    config = _common.tiny_config(overrides)
    run, compiled, _, state, batches = _steps.prepare(config)
    hand_over(run, state, handover, steps)
    live = {"state": state}

    def run_steps(n: int) -> dict:
        for _ in range(n):
            live["state"], metrics = compiled(live["state"], next(batches))
        return metrics

    def timed(n: int) -> float:
        start = time.perf_counter()
        jax.block_until_ready(run_steps(n))
        return (time.perf_counter() - start) / n

    commands = {"loss": lambda _: float(run_steps(1)["loss"]), "time": lambda n: timed(int(n)),
                "tokens": lambda _: config.train.global_batch_size * config.train.seq_len}
    if torch_too:
        import _torch_side

        torch_step, torch_timed = _torch_side.load(handover)
        commands.update(torch_loss=lambda _: torch_step(), torch_time=lambda n: torch_timed(int(n)))
    _worker.serve(commands)


def sides(shape_overrides: list[str], handover: Path, steps: int, torch_too: bool = False):
    """(jaxscale worker, PyTorch worker): the jaxscale side first, which writes the handover."""
    me = [sys.executable, str(Path(__file__).resolve())]
    extra = ["--torch_in_process"] if torch_too else []
    ours = _worker.Worker([*me, "--side=jaxscale", f"--handover={handover}", f"--steps={steps}", *extra,
                           *(f"--override={o}" for o in shape_overrides)])
    theirs = _worker.Worker([sys.executable, str(Path(__file__).with_name("_torch_side.py")), str(handover)],
                            env=torch_env())
    return ours, theirs


def torch_env() -> dict:
    """The environment without what this harness set for JAX (its device flags and platform)."""
    env = dict(os.environ)
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(key, None)
    return env


def compare(shape: str, overrides: list[str], rounds: int, steps: int, warmup: int, torch_too: bool) -> dict:
    """One shape: the first two losses of each side, median step times and their ratio; each
    side in its own process, rounds alternating between them."""
    keys = ("jaxscale", "torch") + (("torch_in_process",) if torch_too else ())
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = sides(overrides, Path(tmp), 2 + max(warmup, 1) + rounds * steps, torch_too)
        ask = {"jaxscale": lambda n: ours.ask("time", n), "torch": lambda n: theirs.ask("time", n),
               "torch_in_process": lambda n: ours.ask("torch_time", n)}
        losses = {"jaxscale": [ours.ask("loss") for _ in range(2)], "torch": [theirs.ask("loss") for _ in range(2)]}
        if torch_too:
            losses["torch_in_process"] = [ours.ask("torch_loss") for _ in range(2)]
        for key in keys:
            ask[key](max(warmup, 1))
        times = {key: [] for key in keys}
        for _ in range(rounds):
            for key in keys:
                times[key].append(ask[key](steps))
        version, tokens = theirs.ask("version"), ours.ask("tokens")
        imported = {"jaxscale": ours.close(), "torch": theirs.close()}
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row = {"shape": shape, "overrides": overrides, "losses": losses, "tokens": tokens,
           "jaxscale_ms": medians["jaxscale"], "torch_ms": medians["torch"],
           "ratio": medians["jaxscale"] / medians["torch"], "torch_process_imported": imported["torch"],
           "torch_version": version["torch"], "torch_threads": version["threads"]}
    if torch_too:
        row["torch_in_process_ms"] = medians["torch_in_process"]
    return row


def _table(rows: list[dict]) -> str:
    in_process = "torch_in_process_ms" in rows[0]
    extra = " PyTorch in jaxscale's process, ms/step |" if in_process else ""
    lines = ["| shape | tokens/step | jaxscale ms/step | PyTorch ms/step | ratio jaxscale/torch |" + extra
             + " first losses (jaxscale; torch) |", "|---|---|---|---|---|---|" + ("---|" if in_process else "")]
    for r in rows:
        losses = "; ".join(", ".join(f"{x:.5f}" for x in r["losses"][k]) for k in ("jaxscale", "torch"))
        cell = f" {r['torch_in_process_ms']:.1f} |" if in_process else ""
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['jaxscale_ms']:.1f} | {r['torch_ms']:.1f} | "
                     f"**{r['ratio']:.2f}** |{cell} {losses} |")
    r = rows[0]
    return "\n".join(lines) + (f"\n\nEach side in its own process; PyTorch {r['torch_version']}, "
                               f"{r['torch_threads']} threads, eager.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,gpt2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=60, help="steps of each side before the rounds")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b, for every shape")
    parser.add_argument("--torch_in_process", action="store_true",
                        help="also time PyTorch inside the jaxscale process, as it runs beside JAX")
    parser.add_argument("--side", choices=["jaxscale"], help=argparse.SUPPRESS)  # a worker of the driver
    parser.add_argument("--handover", type=Path, help=argparse.SUPPRESS)
    _common.add_flags(parser)
    args = parser.parse_args(argv)
    _common.fake_cpu_devices(1)  # for the jaxscale side and the machine line; the PyTorch side drops it
    if args.side:
        return jaxscale_side(args.override, args.handover, args.steps, args.torch_in_process)
    rounds, steps, warmup = (1, 2, 0) if args.smoke else (args.rounds, args.steps, args.warmup)
    rows = [compare(shape, SHAPES[shape] + (SMOKE if args.smoke else []) + args.override, rounds, steps, warmup,
                    args.torch_in_process) for shape in args.shapes.split(",")]
    result = {"benchmark": "torch_reference", "rows": rows, "rounds": rounds, "steps": steps, "warmup": warmup}
    _common.report(args, _common.entry("jaxscale against PyTorch on one CPU device", _table(rows)), result)


if __name__ == "__main__":
    main()
