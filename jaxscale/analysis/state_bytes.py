"""The training state's bytes per device by arithmetic: parameters, gradients and Adam's moments
of a model, divided by the mesh axes that split them (the rule table's default placement) and
by ZeRO's stage. jaxscale.plan prints it beside the compiled program's bytes; the layout search
prunes with it before compiling."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax

from jaxscale.models.moe import expert_param_count
from jaxscale.models.transformer import DEFERRED


def param_counts(model) -> dict[str, int]:
    """The model's parameters by how the rules split them: `layers` (the stacked layers' weights:
    pipeline, fsdp, expert, tensor; of them `experts`, the experts' weights, whose own dimension
    takes expert), `layer_vectors` (the layers' vectors along d_model, norm scales and biases:
    pipeline only), `other` (embedding and head: fsdp, expert, tensor) and `vectors` (the final
    norm: never); and of `layers`, `deferred`: the weights whose gradients sharding.overlap=all
    reduces beside the next layer's backward pass (models.transformer.DEFERRED)."""
    counts = dict.fromkeys(("layers", "layer_vectors", "other", "vectors", "deferred"), 0)
    axes = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    paths, shapes = zip(*jax.tree_util.tree_flatten_with_path(model.shapes)[0], strict=True)
    for names, path, shape in zip(axes, paths, shapes, strict=True):
        stacked, vector = names[0] == "layers", set(names) <= {"layers", "norm"}
        kind = ("layer_vectors" if vector else "layers") if stacked else ("vectors" if vector else "other")
        counts[kind] += math.prod(shape.shape)
        if kind == "layers" and len(path) > 1 and getattr(path[1], "key", None) in DEFERRED:
            counts["deferred"] += math.prod(shape.shape)
    counts["experts"] = expert_param_count(model.shapes)
    return counts


def expected_bytes(counts: dict[str, int], shape: Mapping[str, int], zero: int) -> dict[str, float]:
    """The arithmetic: params 4N, grads 4N, Adam 8N, each divided by the devices that split it
    (`param_counts` says which split what) on a mesh of `shape`; ZeRO stage `zero` adds `data` for
    optimizer state (stage >= 1), gradients (>= 2) and parameters (3)."""
    split = shape["fsdp"] * shape["expert"] * shape["tensor"]
    spread = (counts["layers"] / (shape["pipeline"] * split) + counts["layer_vectors"] / shape["pipeline"]
              + counts["other"] / split + counts["vectors"])

    def per_device(bytes_per_param: int, stage: int) -> float:
        return bytes_per_param * spread / (shape["data"] if zero >= stage else 1)

    return {"params": per_device(4, 3), "grads": per_device(4, 2), "opt_state": per_device(8, 1)}
