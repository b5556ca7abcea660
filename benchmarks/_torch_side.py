"""The PyTorch side of benchmarks/torch_reference.py and cpu_profile.py, in a process of its own.

    python benchmarks/_torch_side.py HANDOVER_DIR

serves (benchmarks/_worker.py) `loss` (one step, its loss), `time N` (seconds per step over N
steps) and `profile N` (torch.profiler's self time per part of the step, ms per step, and the
wall time) for the model, optimizer, parameters, batches and learning rates that the jaxscale
side wrote to HANDOVER_DIR (`hand_over` in torch_reference.py). This file never imports JAX or
jaxscale, so PyTorch runs as it would alone: no second runtime's threads, heap or malloc settings.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import _worker
import numpy as np

PARTS = ("attention", "other matmuls", "rest of forward and backward", "optimizer, clipping, metrics")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


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


def torch_stepper(params: dict, spec, optim_cfg, lrs: list[float], batches: list):
    """(step() -> loss, timed(n) -> seconds per step): AdamW with jaxscale's decay mask, step i
    at learning rate lrs[i]."""
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
            group["lr"] = lrs[count[0]]
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


def load(handover: Path):
    """torch_stepper over what the jaxscale side wrote to `handover`."""
    meta = json.loads((handover / "meta.json").read_text())
    arrays = np.load(handover / "arrays.npz")
    params = {}
    for key in arrays.files:
        if key.startswith("param/"):
            *path, leaf = key.removeprefix("param/").split("/")
            node = params
            for name in path:
                node = node.setdefault(name, {})
            node[leaf] = arrays[key]
    batches = [{"inputs": i, "targets": t} for i, t in zip(arrays["inputs"], arrays["targets"])]
    return torch_stepper(params, SimpleNamespace(**meta["spec"]), SimpleNamespace(**meta["optim"]), meta["lrs"],
                         batches)


def part_of(op: str) -> str:
    if "scaled_dot_product" in op:
        return PARTS[0]
    if op in MATMULS:
        return PARTS[1]
    return PARTS[3] if "_foreach" in op or "adam" in op.lower() else PARTS[2]


def profile(timed, steps: int) -> dict:
    """ms per step by part (self time per operator, torch.profiler), the wall time and threads."""
    import torch
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed(steps)
    parts = collections.Counter()
    for event in prof.key_averages():
        parts[part_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return {"step_ms": wall * 1e3, "parts_ms": {p: parts[p] for p in PARTS}, "threads": torch.get_num_threads()}


def main(handover: str) -> None:
    import torch

    step, timed = load(Path(handover))
    _worker.serve({"loss": lambda _: step(), "time": lambda n: timed(int(n)),
                   "profile": lambda n: profile(timed, int(n)),
                   "version": lambda _: {"torch": torch.__version__, "threads": torch.get_num_threads()}})


if __name__ == "__main__":
    main(sys.argv[1])
