"""jaxscale's train step against the same model, batch and optimizer written in PyTorch, on one CPU device.

    python benchmarks/torch_reference.py [--shapes=tiny,gpt2] [--rounds=7] [--steps=10] [--warmup=60]
        [--override=a.b=v ...] [--json] [--append] [--smoke]

Shapes: `tiny` is configs/tiny.py (Llama-style: RMSNorm, RoPE, grouped-query attention, SwiGLU,
tied embeddings; batch 16 x 128); `gpt2` is nanoGPT's CPU example (4 layers, width 128, 4 heads,
MLP 512, LayerNorm with biases, learned positions, tanh GELU, byte vocabulary, batch 12 x 64).
The PyTorch side is written as a well-kept PyTorch script would: one module per layer,
F.scaled_dot_product_attention (causal, GQA), F.cross_entropy, clip_grad_norm_, torch.optim.AdamW
(foreach) with the same decay mask and learning-rate schedule; eager mode, torch's default
threads. It starts from jaxscale's initial parameters and takes jaxscale's batches, so the
first two losses must agree (checked): the two sides compute the same thing. jaxscale runs its
compiled train step (metrics, clipping, guard included) on its own data pipeline.
Rounds interleave the two, `--steps` steps each, after `--warmup` steps of each (steady state: in
its first tens of steps jaxscale's heap still grows, jaxscale/cpu_malloc.py); medians over
rounds, ratio jaxscale / torch.
"""

from __future__ import annotations

import _common  # noqa: I001  (first: puts this checkout's jaxscale on sys.path)

_common.fake_cpu_devices(1)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

SHAPES = {
    "tiny": [],
    "gpt2": ["model.family=gpt2", "model.num_layers=4", "model.d_model=128", "model.num_heads=4",
             "model.num_kv_heads=4", "model.d_ff=512", "model.vocab_size=256", "train.seq_len=64",
             "train.global_batch_size=12"],
}
SMOKE = ["model.num_layers=1", "train.global_batch_size=4", "train.seq_len=32"]


class TorchModel:
    """The jaxscale model's math in PyTorch, its parameters copied from jaxscale's."""

    def __init__(self, params: dict, spec):
        import torch

        self.spec, self.torch = spec, torch
        flat = {}

        def visit(prefix, node):
            for key, value in node.items():
                visit(f"{prefix}{key}.", value) if isinstance(value, dict) else flat.__setitem__(prefix + key, value)

        visit("", params)
        self.params = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in flat.items()
                       if not k.startswith("layers.")}
        self.layers = [{k.removeprefix("layers."): torch.tensor(np.array(v[i]), requires_grad=True)
                        for k, v in flat.items() if k.startswith("layers.")} for i in range(spec.num_layers)]
        half = spec.d_model // spec.num_heads // 2
        self.freq = spec.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)

    def named(self):
        yield from self.params.items()
        for layer in self.layers:
            yield from layer.items()

    def _norm(self, x, p, name):
        F = self.torch.nn.functional
        if self.spec.family == "llama":
            return F.rms_norm(x, (x.shape[-1],), p[f"{name}.scale"], self.spec.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), p[f"{name}.scale"], p[f"{name}.bias"], self.spec.norm_eps)

    def _rope(self, x):  # [B, L, H, E], rotate-half form
        angle = self.torch.arange(x.shape[1], dtype=self.torch.float32)[:, None] * self.freq
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        x1, x2 = x.chunk(2, -1)
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def _project(self, h, p, name):
        w = p[f"attn.w{name}"]
        y = (h @ w.reshape(w.shape[0], -1)).view(*h.shape[:2], *w.shape[1:])
        return y + p[f"attn.bias_{name}"] if self.spec.family == "gpt2" else y

    def _attention(self, h, p):
        F = self.torch.nn.functional
        q, k, v = (self._project(h, p, name) for name in "qkv")
        if self.spec.family == "llama":
            q, k = self._rope(q), self._rope(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=q.shape[2] != k.shape[2])
        wo = p["attn.wo"]
        out = out.transpose(1, 2).reshape(*h.shape[:2], -1) @ wo.reshape(-1, wo.shape[-1])
        return out + p["attn.bias_o"] if self.spec.family == "gpt2" else out

    def _mlp(self, h, p):
        F = self.torch.nn.functional
        if self.spec.family == "llama":
            return (F.silu(h @ p["mlp.w_gate"]) * (h @ p["mlp.w_up"])) @ p["mlp.w_down"]
        return F.gelu(h @ p["mlp.w_in"] + p["mlp.bias_in"], approximate="tanh") @ p["mlp.w_out"] + p["mlp.bias_out"]

    def loss(self, inputs, targets):
        embed = self.params["embed"]
        x = embed[inputs]
        if self.spec.family == "gpt2":
            x = x + self.params["pos_embed"][: inputs.shape[1]]
        for p in self.layers:
            x = x + self._attention(self._norm(x, p, "attn_norm"), p)
            x = x + self._mlp(self._norm(x, p, "mlp_norm"), p)
        logits = self._norm(x, self.params, "final_norm") @ embed.T
        return self.torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def torch_stepper(params: dict, spec, optim_cfg, schedule, batches: list):
    """(step() -> loss, timed(n) -> seconds per step): AdamW with jaxscale's decay mask and schedule."""
    import torch

    model = TorchModel(params, spec)
    decay = [v for k, v in model.named() if not (k.endswith("scale") or k.split(".")[-1].startswith("bias"))]
    rest = [v for k, v in model.named() if k.endswith("scale") or k.split(".")[-1].startswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim_cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=optim_cfg.lr,
                            betas=(optim_cfg.b1, optim_cfg.b2), eps=optim_cfg.eps, foreach=True)
    data = [tuple(torch.tensor(np.asarray(b[key]), dtype=torch.long) for key in ("inputs", "targets")) for b in batches]
    count = [0]

    def step() -> float:
        inputs, targets = data[count[0] % len(data)]
        for group in opt.param_groups:
            group["lr"] = float(schedule(count[0]))
        loss = model.loss(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if optim_cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(decay + rest, optim_cfg.clip_norm, foreach=True)
        opt.step()
        count[0] += 1
        return loss.item()

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - start) / n

    return step, timed


def torch_side(run, state):
    """torch_stepper from the run's initial parameters, on the run's first batches."""
    import jax

    from jaxscale.data import make_data
    from jaxscale.optim import make_schedule

    config = run.config
    same = make_data(config, run.batch_sharding).train_batches(0)
    held = [jax.device_get(next(same)) for _ in range(8)]
    return torch_stepper(jax.device_get(state.params), run.model.spec, config.optim,
                         make_schedule(config.optim, config.train.steps), held)


def compare(shape: str, overrides: list[str], rounds: int, steps: int, warmup: int) -> dict:
    """One shape: the first two losses of each side, median step times and their ratio."""
    import jax

    import _steps

    config = _common.tiny_config(overrides)
    run, compiled, _, state, ours = _steps.prepare(config)
    torch_step, torch_timed = torch_side(run, state)
    losses = {"torch": [torch_step(), torch_step()], "jaxscale": []}
    live = {"state": state, "batches": ours}

    def jax_timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            live["state"], metrics = compiled(live["state"], next(live["batches"]))
            if len(losses["jaxscale"]) < 2:
                losses["jaxscale"].append(float(metrics["loss"]))
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / n

    jax_timed(max(warmup, 2))
    torch_timed(max(warmup, 1))
    times = {"jaxscale": [], "torch": []}
    for _ in range(rounds):
        times["jaxscale"].append(jax_timed(steps))
        times["torch"].append(torch_timed(steps))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": shape, "overrides": overrides, "losses": losses,
            "tokens": config.train.global_batch_size * config.train.seq_len,
            "jaxscale_ms": medians["jaxscale"] * 1e3, "torch_ms": medians["torch"] * 1e3,
            "ratio": medians["jaxscale"] / medians["torch"]}


def _table(rows: list[dict], torch_version: str, threads: int) -> str:
    lines = ["| shape | tokens/step | jaxscale ms/step | PyTorch ms/step | ratio jaxscale/torch "
             "| first losses (jaxscale; torch) |", "|---|---|---|---|---|---|"]
    for r in rows:
        losses = "; ".join(", ".join(f"{x:.5f}" for x in r["losses"][k]) for k in ("jaxscale", "torch"))
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['jaxscale_ms']:.1f} | {r['torch_ms']:.1f} | "
                     f"**{r['ratio']:.2f}** | {losses} |")
    return "\n".join(lines) + f"\n\nPyTorch {torch_version}, {threads} threads, eager."


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,gpt2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=60, help="steps of each side before the rounds")
    parser.add_argument("--override", action="append", default=[], help="a.b=value, as --config.a.b, for every shape")
    _common.add_flags(parser)
    args = parser.parse_args(argv)
    rounds, steps, warmup = (1, 2, 0) if args.smoke else (args.rounds, args.steps, args.warmup)
    rows = [compare(shape, SHAPES[shape] + (SMOKE if args.smoke else []) + args.override, rounds, steps, warmup)
            for shape in args.shapes.split(",")]
    result = {"benchmark": "torch_reference", "rows": rows, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rounds": rounds, "steps": steps, "warmup": warmup}
    text = _common.entry("jaxscale against PyTorch on one CPU device", _table(rows, torch.__version__,
                                                                              torch.get_num_threads()))
    _common.report(args, text, result)


if __name__ == "__main__":
    main()
