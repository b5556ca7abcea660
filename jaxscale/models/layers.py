"""Building blocks shared by the transformer variants. Every parameter names its axes.

Shapes are written into names: B batch, L length, D d_model, H heads, K kv heads,
E head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models import fp8, lora, rope
from jaxscale.models.attention import (
    Placement,
    cached_attention,
    kept,
    ring_attention,
    self_attention,
    write_cache,
)
from jaxscale.models.matmul import project
from jaxscale.names import AXES_KEY
from jaxscale.parallel import collective_matmul, context
from jaxscale.sharding import constrain

# Logical names of activations (see jaxscale.sharding): the residual stream, the inside of
# tensor-parallel regions, and the MLP's hidden activations.
RESIDUAL = ("batch", "length", "act_embed")
INNER = ("batch", "act_length", "act_embed")
HIDDEN = ("batch", "act_length", "act_mlp")



@dataclasses.dataclass(frozen=True)
class Matmul:
    """How a layer multiplies by its weights: in fp8 (models.fp8, model.fp8), with XLA:CPU's fast
    backward (models.matmul, one CPU device), or as a plain einsum."""

    cpu: bool = False
    fp8: bool = False

    @classmethod
    def of(cls, cfg) -> Matmul:
        return cls(cfg.cpu_matmul, cfg.fp8)

    def __call__(self, x, w, k: int = 1, from_activation: bool = False):
        """x's last k axes contracted with w's first k: [..., C...] @ [C..., O...] -> [..., O...]."""
        return fp8.project(x, w, k) if self.fp8 else project(x, w, k, self.cpu, from_activation)


def _named(value, axes) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, **{AXES_KEY: tuple(axes)})


def normal(rngs: nnx.Rngs, shape, axes: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 parameter drawn from normal(0, std), tagged with its logical axes."""
    return _named(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def zeros(shape, axes) -> nnx.Param:
    return _named(jnp.zeros(shape, jnp.float32), axes)


def ones(shape, axes) -> nnx.Param:
    return _named(jnp.ones(shape, jnp.float32), axes)


class RMSNorm(nnx.Module):
    """x / rms(x) times the scale, or with `unit_offset` times (1 + scale), the scale starting at 0
    (Gemma's: the same function at initialisation, weight decay pulling it towards 1)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        self.scale = zeros((dim,), ("norm",)) if unit_offset else ones((dim,), ("norm",))
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x_BLD):
        x = x_BLD.astype(jnp.float32)  # normalise in fp32 whatever the compute dtype
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x * (1.0 + scale if self.unit_offset else scale)).astype(x_BLD.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = ones((dim,), ("norm",))
        self.bias = zeros((dim,), ("norm",))
        self.eps = eps

    def __call__(self, x_BLD):
        x = x_BLD.astype(jnp.float32)
        x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x_BLD.dtype)


def norm(cfg, dim: int | None = None) -> nnx.Module:
    """A norm of the kind cfg.arch.norm over d_model (or `dim`)."""
    dim = cfg.d_model if dim is None else dim
    if cfg.arch.norm == "layernorm":
        return LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, cfg.arch.unit_offset)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What a layer's attention sees and how it rotates: global (window 0) or a sliding window
    of `window` tokens (each query sees itself and the window - 1 before it), with its RoPE."""

    window: int = 0
    rope_theta: float = 10000.0
    rope_scaling: rope.RopeScaling = rope.RopeScaling()


def collective(cfg) -> bool:
    """Whether model spec `cfg`'s dense layers run their projections as collective matmuls
    (parallel.collective_matmul) where a layer's layout lets them: not with adapters, fp8
    projections or latent attention, which take the plain gathers."""
    return cfg.strategy.collective_matmul and not (cfg.lora.on or cfg.fp8 or cfg.mla.on)


def split_here(cfg, cache=None) -> bool:
    """Whether a layer traced here (`cache`: decoding's, None in training) takes its input split
    along length over `tensor` and runs collective matmuls."""
    return collective(cfg) and cache is None and collective_matmul.applies(cfg.strategy.layout)


HEADS = {"q": ("embed", "heads", "head_dim"), "k": ("embed", "kv_heads", "head_dim"),
         "v": ("embed", "kv_heads", "head_dim")}  # the input projections' logical axes
PROJECTED = {"q": "act_heads", "k": "act_kv_heads", "v": "act_kv_heads"}  # their outputs' heads axis


class Attention(nnx.Module):
    """Causal grouped-query attention: rotary positions when cfg.arch.position is rope, biases
    on the q, k, v projections (attention_bias qkv) and the output too (all); scores scaled by
    cfg.query_scale ** -0.5 (0: the head width's) and soft-capped at cfg.attn_logit_softcap
    (0: not); global or sliding-window as the layer's LayerKind says."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.wq = normal(rngs, (D, H, E), ("embed", "heads", "head_dim"), std)
        self.wk = normal(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        self.wv = normal(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        self.wo = normal(rngs, (H, E, D), ("heads", "head_dim", "embed"), out_std)
        self.use_rope, self.cpu = cfg.arch.position == "rope", cfg.cpu_matmul
        # The kernels scale by E ** -0.5: another scale is folded into the queries.
        self.query_factor = (E / cfg.query_scale) ** 0.5 if cfg.query_scale else 1.0
        self.softcap, self.default_kind = cfg.attn_logit_softcap, cfg.layer_kinds[0]
        self.matmul = Matmul.of(cfg)
        self.impl, self.block, self.strategy = cfg.attention_impl, cfg.attention_block, cfg.strategy
        if cfg.arch.attention_bias != "none":
            self.bias_q = zeros((H, E), ("heads", "head_dim"))
            self.bias_k = zeros((K, E), ("kv_heads", "head_dim"))
            self.bias_v = zeros((K, E), ("kv_heads", "head_dim"))
        if cfg.arch.qk_norm:  # over each head's E: one scale shared by the heads
            self.q_norm, self.k_norm = norm(cfg, E), norm(cfg, E)
        if cfg.arch.attention_bias == "all":
            self.bias_o = zeros((D,), ("norm",))
        for name in lora.ATTENTION_TARGETS:
            lora.attach(self, cfg.lora, name, 2 if name == "o" else 1, rngs)

    def _project(self, x_BLD, name, seeds=None, y=None):
        """Projection `name` (q, k or v) of x_BLD, or its product `y` already computed, with its
        adapters and bias, placed as attention's heads."""
        if y is None:
            w = getattr(self, lora.weight_name(name))[...]
            y = lora.adapt(self, name, x_BLD, self.matmul(x_BLD, w, 1), 1, seeds)
        y = y + getattr(self, f"bias_{name}")[...] if hasattr(self, f"bias_{name}") else y
        return constrain(y, self.strategy.layout, ("batch", "act_length", PROJECTED[name], "head_dim"))

    def _projections(self, x_BLD, seeds, split: bool):
        """(q, k, v); with `split` from x_BLD split along length over `tensor`, by one collective matmul."""
        if not split:
            return [self._project(x_BLD, name, seeds) for name in HEADS]
        products = collective_matmul.gathered(
            x_BLD, [(getattr(self, f"w{name}")[...], axes) for name, axes in HEADS.items()],
            lambda x, w: self.matmul(x, w, 1), self.strategy.layout,
            [("batch", "act_length", PROJECTED[name], "head_dim") for name in HEADS])
        return [self._project(x_BLD, name, y=y) for name, y in zip(HEADS, products)]

    def __call__(self, x_BLD, places: Placement, cache=None, kind: LayerKind | None = None, split: bool = False):
        """(out_BLD, cache). Without a cache (training), causal attention over this sequence
        (within each document when places.segments is set) and cache None. With one ({'k', 'v'}:
        [B, S, K, E], decoding), the new keys and values are written at their positions and the
        queries attend to the updated cache, which is returned. `kind`: the layer's (None: the
        first of the model's layer pattern, its only one when the pattern is uniform). `split`:
        x_BLD and out_BLD split along length over `tensor`, projected by collective matmuls
        (`split_here`)."""
        kind = self.default_kind if kind is None else kind
        q_BLHE, k_BLKE, v_BLKE = self._projections(x_BLD, places.seeds, split)
        if hasattr(self, "q_norm"):
            q_BLHE, k_BLKE = self.q_norm(q_BLHE), self.k_norm(k_BLKE)
        positions_BL = places.positions
        if self.use_rope:
            tables = rope.tables(positions_BL, q_BLHE.shape[-1], kind.rope_theta, kind.rope_scaling, self.cpu)
            q_BLHE, k_BLKE = rope.rotate(q_BLHE, tables), rope.rotate(k_BLKE, tables)
        if self.query_factor != 1.0:
            q_BLHE = q_BLHE * jnp.asarray(self.query_factor, q_BLHE.dtype)
        masks = dict(window=kind.window, softcap=self.softcap)
        if cache is not None and kind.window:  # a ring of the window's slots (models.decoding)
            out_BLHE, cache = ring_attention(q_BLHE, k_BLKE, v_BLKE, cache, positions_BL, **masks)
        elif cache is not None:
            cache = dict(k=write_cache(cache["k"], k_BLKE, positions_BL),
                         v=write_cache(cache["v"], v_BLKE, positions_BL))
            out_BLHE = cached_attention(q_BLHE, cache["k"], cache["v"], positions_BL, **masks)
        else:
            out_BLHE = causal(q_BLHE, k_BLKE, v_BLKE, places, self, **masks)
        out_BLD = output(self, out_BLHE, places.seeds, split)
        return (out_BLD + self.bias_o[...] if hasattr(self, "bias_o") else out_BLD), cache


def causal(q_BLHE, k_BLKE, v_BLKE, places: Placement, layer, window: int = 0, softcap: float = 0.0):
    """Training's causal attention of an attention layer (its kernel, block and strategy): the
    ring, all-gather or all-to-all (ulysses) of context parallelism (tokens in zig-zag order, see
    LanguageModel.loss), else the layer's kernel on each device's rows."""
    s = layer.strategy
    if s.context != "none":
        split = functools.partial(context.attention, layout=s.layout, mode=s.context, block=layer.block,
                                  window=window, softcap=softcap)
        return kept(split)(q_BLHE, k_BLKE, v_BLKE, places.positions, places.segments)
    return self_attention(q_BLHE, k_BLKE, v_BLKE, places, layer.impl, layer.block, s.layout, window, softcap)


def output(layer, out_BLHE, seeds=None, split: bool = False):
    """The heads' output [B, L, H, E] projected back to d_model by the layer's wo [H, E, D]
    (seeds: the tokens' LoRA dropout seeds, or None); with `split`, by a collective matmul whose
    output is split along length over `tensor`."""
    heads = ("batch", "act_length", "act_heads", "head_dim")
    out_BLHE = constrain(out_BLHE, layer.strategy.layout, heads)
    if split:
        return collective_matmul.scattered(out_BLHE, layer.wo[...], lambda h, w: layer.matmul(h, w, 2),
                                           layer.strategy.layout, heads, ("heads", "head_dim", "embed"))
    return lora.adapt(layer, "o", out_BLHE, layer.matmul(out_BLHE, layer.wo[...], 2), 2, seeds)


@dataclasses.dataclass(frozen=True)
class MLPKind:
    """An MLP as data: an input projection w_<name> [D, F] for each of `inputs`, combined by
    `activation` into the hidden [..., F], then the output projection w_<output> [F, D]; with
    biases, bias_<name> after each. The dense MLP and the experts (models.moe) run it alike."""

    inputs: tuple[str, ...]
    output: str
    activation: Callable
    from_activation: bool  # the hidden is an elementwise tail's output: see models.matmul

    def run(self, x, w: dict, dot: Callable, bias: Callable, hidden: Callable = lambda h: h,
            adapt: Callable = lambda name, x, y: y, inputs: Callable | None = None):
        """The MLP of x with weights w (by name: 'w_up', 'bias_up', ...): dot(x, weight, output)
        projects (output: the output projection), adapt(name, x, y) adds a projection's adapters
        (models.lora), bias(y, b) adds a bias, hidden(h) places the hidden activations;
        inputs(x, weights), where given, gives the input projections' products at once (no
        adapters: collective matmuls)."""
        def biased(y, name):
            return bias(y, w[f"bias_{name}"]) if f"bias_{name}" in w else y

        def project(x, name, output):
            return biased(adapt(name, x, dot(x, w[f"w_{name}"], output)), name)

        if inputs is None:
            ins = [project(x, name, False) for name in self.inputs]
        else:
            ins = [biased(y, name) for y, name in zip(inputs(x, [w[f"w_{n}"] for n in self.inputs]), self.inputs)]
        return project(hidden(self.activation(*ins)), self.output, True)

    def attach(self, module, biased: bool, weight: Callable, bias: Callable) -> None:
        """Set w_<name> (and with `biased` bias_<name>) on `module` for each projection, inputs
        first: weight(name, output) and bias(name, output) make them (output: the output
        projection). Weights are drawn in this order, so it fixes the initialisation."""
        for name, output in [*((n, False) for n in self.inputs), (self.output, True)]:
            setattr(module, f"w_{name}", weight(name, output))
            if biased:
                setattr(module, f"bias_{name}", bias(name, output))

    def names(self, bias: bool) -> tuple[str, ...]:
        """The parameter names, weights then biases."""
        names = (*self.inputs, self.output)
        return tuple(f"w_{n}" for n in names) + (tuple(f"bias_{n}" for n in names) if bias else ())


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _gelu(h):
    return jax.nn.gelu(h, approximate=True)


def _geglu(gate, up):
    return _gelu(gate) * up


# Architecture.mlp -> its kind. GELU's output projection asks for the CPU backward that keeps the
# activation's tail out of the transposed operand (models.matmul); on SwiGLU's it was no faster.
MLPS = {"swiglu": MLPKind(("gate", "up"), "down", _swiglu, False),
        "gelu": MLPKind(("in",), "out", _gelu, True),
        "geglu": MLPKind(("gate", "up"), "down", _geglu, False)}


class MLP(nnx.Module):
    """The dense MLP of kind cfg.arch.mlp (MLPS), with biases when cfg.arch.mlp_bias."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.kind, self.biased = MLPS[cfg.arch.mlp], cfg.arch.mlp_bias
        self.matmul, self.layout = Matmul.of(cfg), cfg.strategy.layout
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.kind.attach(self, self.biased,
                         lambda _, output: (normal(rngs, (F, D), ("mlp", "embed"), out_std) if output else
                                            normal(rngs, (D, F), ("embed", "mlp"), cfg.init_std)),
                         lambda _, output: zeros((D,), ("norm",)) if output else zeros((F,), ("mlp",)))
        for name in (*self.kind.inputs, self.kind.output):
            lora.attach(self, cfg.lora, name, 1, rngs)

    def __call__(self, x_BLD, seeds=None, split: bool = False):
        """The MLP of x_BLD (seeds: the tokens' LoRA dropout seeds, or None; `split`: x_BLD and
        the output split along length over `tensor`, projected by collective matmuls)."""
        w = {name: getattr(self, name)[...] for name in self.kind.names(self.biased)}

        def dot(x, w, output):
            return self.matmul(x, w, from_activation=output and self.kind.from_activation)

        def hidden(h_BLF):
            return constrain(h_BLF, self.layout, HIDDEN)

        if split:  # no adapters: see `collective`
            return self.kind.run(x_BLD, w, self._scattering(dot), lambda y, b: y + b, hidden,
                                 inputs=self._gathering(dot))
        adapt = functools.partial(lora.adapt, self, seeds=seeds)
        return self.kind.run(x_BLD, w, dot, lambda y, b: y + b, hidden, adapt)

    def _gathering(self, dot):
        """The input projections of x split along length over `tensor`, by one collective matmul."""
        def inputs(x_BLD, weights):
            return collective_matmul.gathered(x_BLD, [(v, ("embed", "mlp")) for v in weights],
                                              lambda x, v: dot(x, v, False), self.layout, [HIDDEN] * len(weights))
        return inputs

    def _scattering(self, dot):
        """The output projection by a collective matmul, its output split along length over
        `tensor` (MLPKind.run's `dot` when `_gathering` gives the inputs: it projects the output alone)."""
        def projected(h, v, _output):
            return collective_matmul.scattered(h, v, lambda h, v: dot(h, v, True), self.layout, HIDDEN,
                                               ("mlp", "embed"))
        return projected
