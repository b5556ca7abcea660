"""The model as the rest of jaxscale sees it: `LanguageModel`, pure functions over a plain nested
dict of float32 parameters (init, apply, the training loss, decoding), with `axes` giving each
parameter's logical axis names; and `model_from_config`, the model a run's config and platform
call for. The modules and the layer loop are models.transformer's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.errors import ConfigError
from jaxscale.models import decoding, fp8, pipelined, prediction
from jaxscale.models.attention import Placement, document_positions, resolve_impl
from jaxscale.models.latent import widths
from jaxscale.models.layers import AXES_KEY
from jaxscale.models.moe import EXPERT_LOAD, LOAD, MAX_LOAD, STATS
from jaxscale.models.precision import compute_dtype
from jaxscale.models.spec import ModelSpec
from jaxscale.models.strategy import Strategy, overlap_for
from jaxscale.models.transformer import Transformer, unflatten
from jaxscale.names import UNROLL_UP_TO
from jaxscale.parallel import collective_matmul, context, fsdp
from jaxscale.sharding import Layout


def _axes_of(path, variable) -> tuple[str, ...]:
    axes = variable.get_metadata()[AXES_KEY]
    return ("layers",) + axes if path[0] in ("layers", "mtp") else axes  # stacks of layers, of modules


class LanguageModel:
    """Pure functions over a parameter dict: init(key) -> params, apply(params, tokens) -> logits,
    and decoding with a KV cache: init_cache(batch, max_len, dtype), decode(params, tokens, positions, cache)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        abstract = nnx.eval_shape(lambda: Transformer(spec, nnx.Rngs(0)))
        self.graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        self.axes = unflatten({path: _axes_of(path, v) for path, v in flat})
        self.shapes = nnx.to_pure_dict(state)  # ShapeDtypeStructs of every parameter

    def init(self, key) -> dict:
        """float32 parameters from a PRNG key; the values do not depend on the device count."""
        rngs = nnx.Rngs(params=key, lora=jax.random.fold_in(key, 1))  # adapters' own stream (models.lora)
        return nnx.to_pure_dict(nnx.split(Transformer(self.spec, rngs))[1])

    def apply(self, params: dict, tokens_BL, positions_BL=None, segments_BL=None):
        """Logits [B, L, V] in float32; params may be in any float dtype (the compute dtype)."""
        return self.apply_with_stats(params, tokens_BL, positions_BL, segments_BL)[0]

    def apply_with_stats(self, params: dict, tokens_BL, positions_BL=None, segments_BL=None):
        """(logits [B, L, V] float32, router statistics: {} for a dense model, else the float32
        scalars moe.STATS averaged over the MoE layers). segments_BL (int32 [B, L], None: one
        document a row): packed documents, each token attending only within its own, positions
        counted from each document's start. Tokens in their natural order when positions_BL is
        None; with a context-parallel strategy they are laid out in zig-zag order for the
        forward and the logits returned in natural order. Given positions_BL, the tokens are
        taken as laid out."""
        if positions_BL is not None:
            return self._forward(params, tokens_BL, Placement(positions_BL, segments_BL))
        (tokens_BL,), places, order = self._lay_out((tokens_BL,), segments_BL)
        logits_BLV, stats = self._forward(params, tokens_BL, places)
        return (logits_BLV, stats) if order is None else (logits_BLV[:, np.argsort(order)], stats)

    def loss(self, params: dict, inputs_BL, targets_BL, segments_BL=None, count=None, seeds_BL=None):
        """(training objective, metrics): metrics['loss'] is the mean next-token cross entropy;
        an MoE model adds its router losses, weighted, to the objective and its router
        statistics (stat_names) to the metrics, and model.z_loss_weight the logits' z-loss.
        segments_BL as in apply_with_stats. With `count` (step.trained: a loss mask), targets
        that are vocab.IGNORE are not trained and the cross entropy is the sum over the others
        divided by count. seeds_BL (uint32 [B, L], a training step's with LoRA dropout: see
        models.lora) drops the adapters' inputs. With a context-parallel strategy, inputs,
        targets, positions, segments and seeds are reordered together (zig-zag), which leaves
        the function and the mean loss unchanged and saves putting the logits back in order."""
        (inputs_BL, targets_BL), places, _ = self._lay_out((inputs_BL, targets_BL), segments_BL, seeds_BL)
        if self.spec.strategy.pipeline != "none" and self.spec.strategy.context == "none":
            return pipelined.loss(self, params, inputs_BL, targets_BL, places, count)
        return self._objective(*self._loss(params, inputs_BL, targets_BL, places, count))

    def token_losses(self, params: dict, inputs_BL, targets_BL, segments_BL=None, seeds_BL=None):
        """(each target's cross entropy, float32 [B, L], the targets, the router's statistics), the
        tokens in the order the strategy computes in (a row's sums are the same in any order):
        the head's chunked vocabulary-parallel pass, no [B, L, V] logits (seeds_BL: as in loss).
        Not under a pipeline."""
        (inputs_BL, targets_BL), places, _ = self._lay_out((inputs_BL, targets_BL), segments_BL, seeds_BL)
        model = nnx.merge(self.graphdef, params)
        x_BLD, _, stats = model.hidden(inputs_BL, places)
        return model.head_loss(x_BLD, targets_BL, per_token=True), targets_BL, stats

    def _objective(self, loss, stats: dict):
        """(training objective, metrics) from the mean cross entropy and the statistics."""
        return loss + self.extra_loss(stats), {"loss": loss, **stats}

    def _loss(self, params: dict, inputs_BL, targets_BL, places: Placement, count=None):
        """(mean cross entropy, statistics: the router's and the z-loss, see stat_names) of the
        tokens as laid out (count: see loss)."""
        model = nnx.merge(self.graphdef, params)
        x_BLD, _, stats = model.hidden(inputs_BL, places)
        loss, z_loss = model.head_loss(x_BLD, targets_BL, count=count)
        stats = {**stats, "z_loss": z_loss} if self.spec.z_loss_weight else stats
        return loss, {**stats, prediction.LOSS: prediction.loss(model, x_BLD, inputs_BL, targets_BL, places)} \
            if self.spec.mtp_depth else stats

    def _lay_out(self, arrays_BL: tuple, segments_BL, seeds_BL=None):
        """(arrays, Placement, order): token arrays in natural order, with their positions (from each
        document's start when segments are given) and dropout seeds, put in the order the
        strategy computes in: the zig-zag order of context parallelism (order), or as they are
        (order None)."""
        length = arrays_BL[0].shape[1]
        positions_BL = (jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), arrays_BL[0].shape)
                        if segments_BL is None else document_positions(segments_BL))
        s = self.spec.strategy
        places = Placement(positions_BL, segments_BL, seeds_BL)
        if s.context == "none":
            return arrays_BL, places, None
        order = context.zigzag_order(length, s.mesh.shape[context.AXIS])
        arrays_BL, places = jax.tree.map(lambda x: x[:, order], (arrays_BL, places))
        return arrays_BL, places, order

    def _forward(self, params: dict, tokens_BL, places: Placement):
        logits_BLV, _, stats = nnx.merge(self.graphdef, params)(tokens_BL, places)
        return logits_BLV, stats

    def unsharded(self) -> LanguageModel:
        """This model with the default strategy (one program, no manual collectives): for
        decoding and inspection at any batch size, outside the training layout."""
        if self.spec.strategy == Strategy():
            return self
        return LanguageModel(dataclasses.replace(self.spec, strategy=Strategy()))

    @property
    def stat_names(self) -> tuple[str, ...]:
        """The names of the statistics `loss` reports beside the loss: the router's (STATS) for
        an MoE model, `z_loss` (mean squared log-sum-exp of the logits) when weighted, and
        `mtp_loss` (the multi-token prediction modules' mean cross entropy) with them."""
        moe = (*STATS, MAX_LOAD) if self.spec.moe.num_experts else ()
        return (moe + (("z_loss",) if self.spec.z_loss_weight else ())
                + ((prediction.LOSS,) if self.spec.mtp_depth else ()))

    @property
    def stat_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every statistic `loss` reports: stat_names' scalars, an MoE model's load per expert
        (moe.EXPERT_LOAD, [experts]), and with balancing by bias the MoE layers' loads (moe.LOAD,
        [MoE layers, experts]) that the step moves the biases by."""
        shapes = {name: () for name in self.stat_names}
        m = self.spec.moe
        if m.num_experts:
            shapes[EXPERT_LOAD] = (m.num_experts,)
        if m.num_experts and m.bias_rate:
            shapes[LOAD] = (m.moe_layers(self.spec.num_layers), m.num_experts)
        return shapes

    def extra_loss(self, stats: dict):
        """What the statistics add to the training objective: moe.aux_loss_weight x the load
        balancing loss + moe.z_loss_weight x the router z-loss (an MoE model), and
        model.z_loss_weight x the logits' z-loss, model.mtp_loss_weight x the multi-token
        prediction loss."""
        m, extra = self.spec.moe, 0.0
        if "moe_aux_loss" in stats:
            extra = m.aux_loss_weight * stats["moe_aux_loss"] + m.z_loss_weight * stats["moe_z_loss"]
        if prediction.LOSS in stats:
            extra = extra + self.spec.mtp_loss_weight * stats[prediction.LOSS]
        return extra + self.spec.z_loss_weight * stats["z_loss"] if "z_loss" in stats else extra

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict:
        """An empty KV cache for `batch` sequences of up to `max_len` tokens, in `dtype` (the
        compute dtype): a stack of {'k', 'v'} per kind of layer (models.decoding)."""
        return decoding.init_cache(self.spec, batch, max_len, dtype)

    def decode(self, params: dict, tokens_BL, positions_BL, cache: dict):
        """(logits_BLV float32, new cache): the tokens' keys and values are written into the cache at
        their positions (consecutive within a row, below max_len) and each token attends to every
        cached position <= its own. One call can prefill a whole prompt; later calls add a token each.
        The cache's slot s must hold position s, so fill it from position 0 without gaps."""
        return decoding.decode(self.graphdef, params, tokens_BL, positions_BL, cache)


def model_from_config(config, platform: str, layout: Layout | None = None) -> tuple[LanguageModel, list[str]]:
    """The model for a run on `platform`, with the attention kernel resolved; notes say what was
    chosen. Given the run's layout, the model's strategy runs the pipeline schedule, context
    parallel attention and expert dispatch its mesh needs (see Strategy.for_layout)."""
    m = config.model
    compiler = platform if layout is None else layout.mesh.devices.flat[0].platform  # CPU devices stand in for GPUs
    impl, note = resolve_impl(m.attention.impl, platform, compute_dtype(m.dtype, platform), widths(m)[0],
                              config.data.document_mask, config.train.seq_len, config.train.deterministic,
                              m.attn_logit_softcap, m.mla.kv_lora_rank > 0)
    strategy = Strategy() if layout is None else Strategy.for_layout(
        layout, schedule=config.pipeline.schedule, microbatches=config.pipeline.microbatches,
        virtual_stages=config.pipeline.virtual_stages, context=m.attention.context_parallel,
        schedule_file=config.pipeline.schedule_file,
        overlap=overlap_for(config.sharding.overlap, compiler),
        collective_matmul=collective_matmul.wanted(config.sharding.collective_matmul, compiler))
    one_cpu = _one_cpu_device(platform, layout)
    cpu_matmul = m.projections == "cpu" or (m.projections == "auto" and one_cpu)
    reason = m.fp8 and fp8.unsupported(platform, None if layout is None else list(layout.mesh.devices.flat))
    if reason:
        raise ConfigError("model.fp8", m.fp8, f"{reason}; set it to False")
    weights = fsdp.Weights.of(compute_dtype(m.dtype, platform), config.optim.grad_reduce_dtype or None, compiler)
    spec = ModelSpec.from_config(m, impl, strategy, resolve_layer_loop(m, one_cpu), cpu_matmul=cpu_matmul,
                                 weights=weights)
    return LanguageModel(spec), [note] if note else []


def _one_cpu_device(platform: str, layout: Layout | None) -> bool:
    """A run on one CPU device: the laptop's development loop. Several CPU devices stand in for
    accelerators (tests, plans) and get the program the accelerators would run."""
    return platform == "cpu" and (layout is None or layout.mesh.size == 1)


def resolve_layer_loop(model_cfg, one_cpu: bool) -> bool:
    """Whether to scan the layers. A scan compiles one layer whatever the depth, which accelerators
    and deep models need; on one CPU device its loop costs a small model's step 10-15% (the
    activations saved for the backward pass are stacked and read back through dynamic slices, and
    no fusion crosses a layer: benchmarks/results/cpu_profile.md), so `auto` unrolls up to UNROLL_UP_TO layers
    there."""
    if model_cfg.layer_loop != "auto":
        return model_cfg.layer_loop == "scan"
    return not (one_cpu and model_cfg.num_layers <= UNROLL_UP_TO)
