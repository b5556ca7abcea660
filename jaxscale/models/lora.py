"""LoRA: low-rank adapters beside frozen projections (Hu et al., 2021; PEFT's definition).

A targeted projection y = x W (W [C..., O...], contracting x's last k axes) becomes
y = x W + (alpha / rank) (drop(x) A) B, with A [C..., r] drawn as PEFT draws it (uniform within
1/sqrt(fan_in)) and B [r, O...] zero, so training starts from the base model's function. drop is
PEFT's lora_dropout: in a training step each element of the adapters' input is zeroed with
probability `dropout` and the rest scaled by 1 / (1 - dropout); elsewhere (evaluation, decoding,
the frozen base's own product) nothing is dropped. A and
B carry W's logical axes on their outer sides and `lora_rank` (never split) between, so each
layout splits and gathers them as it does W. Only the adapters train: `split` takes them out of
the parameter tree (the optimizer's and the gradients' tree), the rest is the frozen base, and
`merge` puts the two back together for the forward pass.

Dropout draws no key inside the model: each token carries a uint32 seed (Placement.seeds, drawn
from the step's key over the whole batch), moved along by the layer's index (Placement.at_layer),
and an element's mask is a hash of that seed, the target's name and the element's index within
the token. So a token's masks are the same whichever device, microbatch, pipeline stage or
sequence shard computes it, and a run with dropout trains as on one device under every layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.models.matmul import project
from jaxscale.names import AXES_KEY

# Adapter parameters are named <PREFIX><target>_a and <PREFIX><target>_b beside their weight.
PREFIX = "lora_"
RANK_AXIS = "lora_rank"
# The projections an adapter may target: attention's query, key, value and output, and the MLP's
# (models.layers.MLPS: SwiGLU/GeGLU gate, up, down; GELU in, out).
ATTENTION_TARGETS = ("q", "k", "v", "o")


def weight_name(target: str) -> str:
    """The weight a target names, beside its adapters: attention's w<target>, the MLP's w_<target>."""
    return f"w{target}" if target in ATTENTION_TARGETS else f"w_{target}"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """config.model.lora: rank 0 trains every parameter (no adapters)."""

    rank: int = 0
    alpha: float = 16.0
    targets: str = "q,k,v,o,gate,up,down"  # comma-separated: ATTENTION_TARGETS and the MLP's projections
    base_dtype: str = "float32"            # the frozen base's storage dtype (bfloat16 halves it)
    dropout: float = 0.0                   # PEFT's lora_dropout on the adapters' input, while training

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def adapts(self, name: str) -> bool:
        return self.on and name in self.target_names


def attach(module: nnx.Module, spec: LoraSpec, name: str, k: int, rngs: nnx.Rngs) -> None:
    """Give `module` the adapters of its weight for `name` (weight_name; contracting its first k
    axes) when `spec` targets it: <PREFIX><name>_a [C..., r] and <PREFIX><name>_b [r, O...]. A is
    drawn from the `lora` stream of `rngs`, so the base's weights are the same with adapters or without."""
    if not spec.adapts(name):
        return
    module.adapter_scale, module.adapter_dropout = spec.scale, spec.dropout
    weight = getattr(module, weight_name(name))
    axes, shape = weight.get_metadata()[AXES_KEY], weight.shape
    bound = 1.0 / math.sqrt(math.prod(shape[:k]))  # kaiming_uniform(a=sqrt(5)), as PEFT draws A
    a = jax.random.uniform(rngs.lora(), (*shape[:k], spec.rank), jnp.float32, -bound, bound)
    setattr(module, f"{PREFIX}{name}_a", nnx.Param(a, **{AXES_KEY: (*axes[:k], RANK_AXIS)}))
    b = jnp.zeros((spec.rank, *shape[k:]), jnp.float32)
    setattr(module, f"{PREFIX}{name}_b", nnx.Param(b, **{AXES_KEY: (RANK_AXIS, *axes[k:])}))


def adapt(module: nnx.Module, name: str, x, y, k: int = 1, seeds=None):
    """y (= x W) plus the adapters' (alpha / rank) (drop(x) A) B when `module` has them for
    `name`; with `seeds` (the tokens' dropout seeds [B, L], Placement.seeds) x is dropped first."""
    if not hasattr(module, f"{PREFIX}{name}_a"):
        return y
    if seeds is not None and module.adapter_dropout:
        x = drop(x, seeds, name, k, module.adapter_dropout)
    a, b = getattr(module, f"{PREFIX}{name}_a")[...], getattr(module, f"{PREFIX}{name}_b")[...]
    low = project(x, a.astype(x.dtype), k)
    return y + (project(low, b.astype(x.dtype), 1) * jnp.asarray(module.adapter_scale, x.dtype)).astype(y.dtype)


def _mix(h):
    """MurmurHash3's 32-bit finaliser: every input bit moves every output bit."""
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def kept(seeds_BL, shape, name: str, rate: float):
    """The dropout mask (True: kept) of an input of `shape` [B, L, ...] to target `name`'s
    adapters: element i of token t is kept unless hash(t's seed, name, i) falls in the lowest
    `rate` of uint32's range. The index i runs over the token's elements in the array's global
    shape (an iota, which the partitioner numbers globally), so a split feature axis draws the
    same mask as a whole one."""
    token = _mix(seeds_BL.astype(jnp.uint32) ^ np.uint32(zlib.crc32(name.encode())))
    features = shape[2:]
    index = jnp.zeros(features, jnp.uint32)
    for axis, size in enumerate(features):  # the row-major index of each element within a token
        index = index * np.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, features, axis)
    h = _mix(token.reshape(*token.shape, *(1,) * len(features)) + index * np.uint32(0x9E3779B9))
    return h >= np.uint32(min(round(rate * 2.0 ** 32), 2 ** 32 - 1))


def drop(x, seeds_BL, name: str, k: int, rate: float):
    """x [B, L, ...] with inverted dropout at `rate` (kept elements scaled by 1 / (1 - rate)), the
    masks of `kept`; k: the trailing axes the adapters contract (the elements of a token)."""
    assert x.ndim == 2 + k, (x.shape, k)
    scale = jnp.asarray(1.0 / (1.0 - rate), x.dtype)
    return jnp.where(kept(seeds_BL, x.shape, name, rate), x * scale, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class DotsButTheAdapters:
    """The remat policy `dots_saveable` with adapters: keep the matmuls' outputs but the adapters'
    last, (x A) B, as wide as the projection's output. The gradients never need it; kept, it
    added 41% to a layer's saved activations (4-layer SwiGLU model, seq 256, rank 8); recomputed
    from x A it costs 2 r FLOPs an output. It is the one matmul that contracts a single axis of
    `rank` with no batch axes (a weight of width `rank` would be recomputed too: slower, not wrong)."""

    rank: int

    def __call__(self, prim, *avals, **params) -> bool:
        if prim is jax.lax.dot_general_p:
            (contracting, _), (batch, _) = params["dimension_numbers"]
            if not batch and len(contracting) == 1 and avals[0].shape[contracting[0]] == self.rank:
                return False
        return jax.checkpoint_policies.dots_saveable(prim, *avals, **params)


def is_adapter(path) -> bool:
    """Whether the parameter at `path` (a tuple of keys) is an adapter."""
    return str(path[-1]).startswith(PREFIX)


def _partition(tree: dict, keep, path=()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub = _partition(value, keep, (*path, key))
            if sub:
                out[key] = sub
        elif keep((*path, key)):
            out[key] = value
    return out


def split(tree: dict) -> tuple[dict, dict]:
    """(adapters, base) of a parameter-shaped tree: each nested like the tree, holding only its
    own leaves."""
    return _partition(tree, is_adapter), _partition(tree, lambda p: not is_adapter(p))


def merge(adapters: dict, base: dict) -> dict:
    """The parameter tree of `split`'s two halves."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = merge(value, base.get(key, {})) if isinstance(value, dict) else value
    return out


def folded(params: dict, spec: LoraSpec) -> dict:
    """The parameters with each adapter folded into its weight, W + (alpha / rank) A B, and the
    adapters gone: the merged model, as a checkpoint without LoRA holds it."""
    def fold(node: dict) -> dict:
        out = {key: fold(value) if isinstance(value, dict) else value for key, value in node.items()
               if not str(key).startswith(PREFIX)}
        for key in node:
            if str(key).startswith(PREFIX) and str(key).endswith("_a"):
                name = str(key)[len(PREFIX):-2]
                weight, a, b = weight_name(name), node[key], node[f"{PREFIX}{name}_b"]
                stacked = a.ndim + b.ndim - 2 - out[weight].ndim  # leading layer dimensions of each
                product = functools.partial(project, k=1)  # A [C..., r] @ B [r, O...] -> [C..., O...]
                for _ in range(stacked):
                    product = jax.vmap(product)
                out[weight] = out[weight] + spec.scale * product(a, b)
        return out

    return fold(params)


def without(spec):
    """A ModelSpec `spec` without adapters: the merged model's."""
    return dataclasses.replace(spec, lora=LoraSpec())
