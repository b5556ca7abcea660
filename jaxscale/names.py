"""Names shared by the config and the parts that use it: mesh axes, the default rule table and the
choices each setting takes.

A leaf: it imports only the standard library, so `jaxscale.config` (and anything that just reads
or checks a config) can use these without loading JAX. The modules that own each concept
re-export their names from here (`jaxscale.mesh.AXES`, `jaxscale.sharding.DEFAULT_RULES`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Outer -> inner: axes that talk least sit outermost so they can cross slow links.
AXES = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")
# Axes whose devices each hold a different slice of the batch. `expert` splits the experts of
# MoE layers and the batch everywhere else; MoE layers exchange tokens within an expert group.
BATCH_AXES = ("data", "fsdp", "expert")

# Model axis name -> mesh axes it is split over. Mesh axes of size 1 are dropped from specs,
# so one table serves every layout. Overridable from config: --config.sharding.rules.NAME=a,b
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "embed": ("fsdp", "expert"),  # a weight's model dimension; the experts' is split over fsdp only (their own
                                  # dimension takes expert first: each mesh axis splits one dimension)
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "latent": ("fsdp", "expert"),  # latent attention's compressed width (model.mla): a contraction, as embed
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "position": (),
    "norm": (),              # vectors along d_model (norm scales and biases, output biases): whole everywhere;
                             # gathering 4096 numbers over fsdp costs a collective for nothing
    "experts": ("expert",),  # the expert dimension of expert weights (mixture of experts)
    "router": (),            # the router's output dimension (a score per expert): small, never split
    "lora_rank": (),         # a LoRA adapter's rank (models.lora): small, never split
    # activations
    "batch": BATCH_AXES,
    "length": ("sequence",),
    "act_length": ("sequence",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}

# Metadata key holding a parameter's logical axis names (nnx.Param metadata; jaxscale.sharding maps them).
AXES_KEY = "axes"

# The choices of config settings.
FAMILIES = ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "deepseek_v3")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # model.rope_scaling.type (models.rope)
ROUTER_SCORES = ("softmax", "sigmoid")  # model.moe.score (models.moe.route)
REMAT_POLICIES = ("none", "full", "dots_saveable")
LAYER_LOOPS = ("auto", "scan", "unroll")
PROJECTIONS = ("auto", "einsum", "cpu")
OVERLAPS = ("off", "head", "all")  # models.strategy.Strategy.overlap
OVERLAP_SETTINGS = ("auto", *OVERLAPS)  # sharding.overlap: auto is head on the TPU compiler, off elsewhere
COLLECTIVE_MATMULS = ("auto", "on", "off")  # sharding.collective_matmul (parallel.collective_matmul)
UNROLL_UP_TO = 8  # layer_loop=auto unrolls this many layers or fewer on CPU
DTYPES = ("auto", "float32", "bfloat16")
GRAD_REDUCE_DTYPES = ("", "float32", "bfloat16")  # "": the compute dtype
ATTENTION_IMPLS = ("xla", "cudnn", "splash", "auto")
CONTEXT_PARALLEL = ("ring", "all_gather", "ulysses")
# Schedules jaxscale.parallel.schedules builds by name; "file" reads one written out (pipeline.schedule=file).
BUILT_IN_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
PIPELINE_SCHEDULES = (*BUILT_IN_SCHEDULES, "file")
SOURCES = ("auto", "embedded", "synthetic", "file")
TOKEN_DTYPES = ("uint16", "uint32")
TRAIN_ON = ("all", "assistant", "completion")  # data.train_on: which tokens of chat records are trained
SPIKE_ACTIONS = ("skip", "rollback")
PREFERENCE_LOSSES = ("none", "dpo", "simpo")  # preference.loss (jaxscale.preference)
WANDB_MODES = ("online", "offline", "disabled")  # or "" for W&B's own setting

# Metric writers, and for those needing an optional package: (module it needs, what to pip install).
WRITERS = ("jsonl", "tensorboard", "mlflow", "wandb")
EXTRAS = {"tensorboard": ("tensorboardX", "jaxscale"), "mlflow": ("mlflow", "jaxscale[mlflow]"),
          "wandb": ("wandb", "jaxscale[wandb]")}


def split_ways(axes: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[int, str]:
    """(how many pieces a dimension split over `axes` is cut into, those axes as 'a=2xb=4') for
    error messages; axes of size 1 are left out of the text."""
    parts = math.prod(sizes[axis] for axis in axes)
    return parts, "x".join(f"{axis}={sizes[axis]}" for axis in axes if sizes[axis] > 1)
