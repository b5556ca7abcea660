"""ModelSpec: a model's shape and structure options, as data (hashable; jitted functions close
over it). The modules built from it are models.transformer's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxscale.models.families import Architecture, check, head_size, period, preset
from jaxscale.models.latent import LatentSpec
from jaxscale.models.layers import LayerKind
from jaxscale.models.lora import LoraSpec
from jaxscale.models.moe import MoESpec
from jaxscale.models.rope import RopeScaling
from jaxscale.models.strategy import Strategy
from jaxscale.parallel import fsdp


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model's shape and options; hashable, so jitted functions can close over it."""

    family: str = "llama"             # a named preset of the structure options (models.families)
    architecture: Architecture | None = None  # the structure options; None: the family's (see `arch`)
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 0                 # each attention head's width; 0 = d_model / num_heads (see head_size)
    d_ff: int = 256
    vocab_size: int = 256
    max_seq_len: int = 1024
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()  # scaled rotary frequencies (models.rope); a dict is taken too
    layer_pattern: str = "G"          # each layer's attention, the pattern repeated: G global, L sliding window
    sliding_window: int = 0           # the local layers' window (tokens each query sees, itself included)
    local_rope_theta: float = 0.0     # the local layers' RoPE base, unscaled; 0 = the global layers' RoPE
    query_scale: float = 0.0          # attention scores scaled by query_scale ** -0.5; 0 = the head width
    attn_logit_softcap: float = 0.0   # attention scores s -> cap * tanh(s / cap); 0 = none
    final_logit_softcap: float = 0.0  # logits z -> cap * tanh(z / cap); 0 = none
    norm_eps: float = 1e-5
    init_std: float = 0.02
    remat: str = "none"
    head_chunk_mib: float = 256.0     # the training loss's logits per chunk of the vocabulary (models.vocab)
    z_loss_weight: float = 0.0        # weight of the mean squared log-sum-exp of the logits in the objective
    mtp_depth: int = 0                # multi-token prediction modules (models.prediction); 0 = none
    mtp_loss_weight: float = 0.3      # their mean loss's weight in the objective
    scan_layers: bool = True          # False: the layers as straight-line code (resolve_layer_loop)
    cpu_matmul: bool = False          # projections with XLA:CPU's fast backward (models.matmul; one CPU device)
    fp8: bool = False                 # the layers' projections in fp8 (models.fp8)
    attention_impl: str = "xla"       # a concrete kernel: xla | cudnn | splash (see models.attention.resolve_impl)
    attention_block: int = 512        # the blockwise kernel's tile edge (model.attention.block_size)
    moe: MoESpec = MoESpec()          # mixture of experts (moe.num_experts 0: every MLP dense); a dict is taken too
    mla: LatentSpec = LatentSpec()    # multi-head latent attention (mla.kv_lora_rank 0: GQA); a dict is taken too
    lora: LoraSpec = LoraSpec()       # low-rank adapters on a frozen base (lora.rank 0: none); a dict is taken too
    strategy: Strategy = Strategy()   # how the forward splits over devices (default: one program)
    weights: fsdp.Weights = fsdp.Weights()  # compute and gradient-reduction dtypes of the weights

    @classmethod
    def from_config(cls, model_cfg, attention_impl: str = "xla", strategy: Strategy = Strategy(),
                    scan_layers: bool = True, cpu_matmul: bool = False,
                    weights: fsdp.Weights = fsdp.Weights()) -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)} - {"moe", "mla", "lora", "strategy", "scan_layers",
                                                             "cpu_matmul", "weights"}
        values = {k: v for k, v in model_cfg.items() if k in names}
        for name, kind in (("rope_scaling", RopeScaling), ("moe", MoESpec), ("mla", LatentSpec), ("lora", LoraSpec)):
            if name in model_cfg:
                values[name] = kind(**model_cfg[name].to_dict())
        if "attention" in model_cfg:
            values["attention_block"] = model_cfg.attention.block_size
        return cls(**values, attention_impl=attention_impl, strategy=strategy, scan_layers=scan_layers,
                   cpu_matmul=cpu_matmul, weights=weights)

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # as model_config_from_hf gives it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, dict):  # as model_config_from_hf gives a mixture of experts' fields
            object.__setattr__(self, "moe", MoESpec(**self.moe))
        if isinstance(self.mla, dict):  # as model_config_from_hf gives latent attention's fields
            object.__setattr__(self, "mla", LatentSpec(**self.mla))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        if self.architecture is not None:
            check(self.architecture)

    @property
    def arch(self) -> Architecture:
        """The structure options the layers are built from: `architecture` where given, else
        the preset of `family`. (Kept apart from the family, so that changing the family of a
        spec, dataclasses.replace(spec, family=...), changes its structure too.)"""
        return preset(self.family) if self.architecture is None else self.architecture

    @property
    def head_size(self) -> int:
        return head_size(self)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's attention over one period of the layer pattern: layer i is kind i % period."""
        glob = LayerKind(0, self.rope_theta, self.rope_scaling)
        local = (LayerKind(self.sliding_window, self.local_rope_theta) if self.local_rope_theta else
                 dataclasses.replace(glob, window=self.sliding_window))
        return tuple(local if c == "L" else glob for c in period(self.layer_pattern))

    @property
    def dtype(self):
        """The compute dtype: weights are cast to it where they are used (parameters stay as given)."""
        return jnp.dtype(self.weights.compute)
