"""The model as data: the structure options a transformer is built from, and the families, each
a named preset of them.

The layers ask the options (`spec.arch.norm`, `spec.arch.position`, ...), never the family's
name; `model.family` only picks the preset. Adding an option is a field here (its default is
what every family did before it), the families that differ, its choices, and the code that
reads it. Plain Python, no JAX: the config checks read it too.
"""

from __future__ import annotations

import dataclasses

from jaxscale.names import FAMILIES as FAMILY_NAMES


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How the transformer's parts are built. Parameter names and shapes follow from these."""

    norm: str = "rmsnorm"         # rmsnorm (scale) | layernorm (scale and bias): every norm of the model
    unit_offset: bool = False     # rmsnorm scales by (1 + scale), the scale starting at 0 (Gemma)
    sandwich_norm: bool = False   # norms after attention and the MLP too, before each joins the residual (Gemma 2/3)
    mlp: str = "swiglu"           # swiglu: silu(x w_gate) * (x w_up) -> w_down | gelu: gelu(x w_in) -> w_out |
                                  # geglu: gelu(x w_gate) * (x w_up) -> w_down (GELU tanh-approximated)
    mlp_bias: bool = False        # biases on the MLP's projections (also the experts' and shared experts')
    position: str = "rope"        # rope: rotary q and k in attention | learned: a table added to the embeddings
    attention_bias: str = "none"  # none | qkv: biases on the q, k, v projections | all: and on the output
    qk_norm: bool = False         # a norm (of `norm`'s kind) over each query and key head before RoPE
    embed_scale: bool = False     # the token embeddings times sqrt(d_model), in the compute dtype (Gemma)


# The values each string option takes.
CHOICES = {"norm": ("rmsnorm", "layernorm"), "mlp": ("swiglu", "gelu", "geglu"), "position": ("rope", "learned"),
           "attention_bias": ("none", "qkv", "all")}

LLAMA = Architecture(norm="rmsnorm", mlp="swiglu", mlp_bias=False, position="rope", attention_bias="none")
# Gemma 2: (1 + scale) RMSNorms before and after attention and the MLP, GeGLU, scaled embeddings.
GEMMA = Architecture(norm="rmsnorm", unit_offset=True, sandwich_norm=True, mlp="geglu", embed_scale=True)
FAMILIES: dict[str, Architecture] = {
    "llama": LLAMA,
    "gpt2": Architecture(norm="layernorm", mlp="gelu", mlp_bias=True, position="learned", attention_bias="all"),
    "mistral": LLAMA,  # Llama's structure under Mistral's name (sliding-window checkpoints are refused)
    "qwen2": dataclasses.replace(LLAMA, attention_bias="qkv"),
    "qwen3": dataclasses.replace(LLAMA, qk_norm=True),
    "gemma2": GEMMA,
    "gemma3": dataclasses.replace(GEMMA, qk_norm=True),
    # Mixtures of experts: the structure of their dense relatives; model.moe.* sets the experts.
    "mixtral": LLAMA,
    "qwen3_moe": dataclasses.replace(LLAMA, qk_norm=True),
    "deepseek_v3": LLAMA,  # with model.mla's latent attention and model.moe's sigmoid-scored, grouped experts
}
assert tuple(FAMILIES) == FAMILY_NAMES, "names.FAMILIES lists the config's choices: keep it in step"


def head_size(m) -> int:
    """Each attention head's width, of a model config or a ModelSpec: model.head_dim, or
    d_model / num_heads when it is 0."""
    return m.head_dim or m.d_model // m.num_heads


def period(pattern: str, layers: int | None = None) -> str:
    """The shortest unit that, repeated, gives the same layers as the layer pattern repeated:
    for any number of layers ("LGLG" -> "LG"), or for the first `layers` ("LGL" of 3 -> "LG";
    Gemma 3 1B's 26 layer types -> "LLLLLG")."""
    if layers is None:
        return next(pattern[:n] for n in range(1, len(pattern) + 1)
                    if len(pattern) % n == 0 and pattern[:n] * (len(pattern) // n) == pattern)
    kinds = expand(pattern, layers)
    return next(kinds[:n] for n in range(1, layers + 1) if expand(kinds[:n], layers) == kinds)


def expand(pattern: str, layers: int) -> str:
    """Each layer's letter: layer i takes the pattern's letter i mod its length."""
    return "".join(pattern[i % len(pattern)] for i in range(layers))


def preset(family: str) -> Architecture:
    """The family's options; a KeyError for an unknown name (the config checks name the field first)."""
    return FAMILIES[family]


def check(arch: Architecture) -> None:
    """Raise ValueError for an option outside its choices."""
    for name, choices in CHOICES.items():
        value = getattr(arch, name)
        if value not in choices:
            raise ValueError(f"Architecture.{name}={value!r}: choose one of {', '.join(choices)}")
    if arch.unit_offset and arch.norm != "rmsnorm":
        raise ValueError(f"Architecture.unit_offset=True: an RMSNorm option (norm is {arch.norm!r})")
