"""Decoder-only transformer in Flax NNX, built from its structure options (models.families:
Llama-style, GPT-2-style, ...), layers stacked and scanned.

This module holds the modules and the layer loop; decoding with a KV cache is models.decoding's,
the fit to a pipeline schedule models.pipelined's.

The rest of jaxscale sees the model through `LanguageModel`: parameters are a plain nested
dict of float32 arrays, and `axes` gives each one's logical axis names.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.errors import ConfigError
from jaxscale.kernels.flash import soft_cap
from jaxscale.models import decoding, fp8, lora, periods, pipelined, prediction
from jaxscale.models.attention import KEPT, Placement, document_positions, resolve_impl
from jaxscale.models.families import head_size
from jaxscale.models.latent import LatentAttention
from jaxscale.models.layers import AXES_KEY, INNER, MLP, RESIDUAL, Attention, norm, normal
from jaxscale.models.moe import EXPERT_LOAD, LOAD, MAX_LOAD, STATS, MoE
from jaxscale.models.precision import compute_dtype
from jaxscale.models.spec import ModelSpec
from jaxscale.models.strategy import Strategy
from jaxscale.models.vocab import Table, cross_entropy, embed
from jaxscale.names import UNROLL_UP_TO
from jaxscale.parallel import context, fsdp
from jaxscale.sharding import Layout, Stored, constrain


def remat_policy(spec: ModelSpec):
    """model.remat's policy: `full` saves nothing inside a layer (it is all recomputed in the
    backward pass); `dots_saveable` keeps the matmuls' outputs (LoRA's wide last product aside,
    lora.DotsButTheAdapters) and the attention kernel's residuals (models.attention.KEPT)."""
    if spec.remat == "full":
        return None
    dots = lora.DotsButTheAdapters(spec.lora.rank) if spec.lora.on else jax.checkpoint_policies.dots_saveable
    return jax.checkpoint_policies.save_from_both_policies(dots, jax.checkpoint_policies.save_only_these_names(KEPT))



class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with sandwich norms
    (arch.sandwich_norm) each branch's output is normed too before it joins the residual."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm, self.mlp_norm = norm(spec), norm(spec)
        if spec.arch.sandwich_norm:
            self.attn_post_norm, self.mlp_post_norm = norm(spec), norm(spec)
        self.attn = LatentAttention(spec, rngs) if spec.mla.on else Attention(spec, rngs)
        self.layout = spec.strategy.layout
        self.mlp = MoE(spec, rngs) if moe else MLP(spec, rngs)

    def _join(self, x_BLD, branch_BLD, post: str):
        """x + the branch's output (normed first by the post norm named `post`, if the block has it)."""
        branch_BLD = getattr(self, post)(branch_BLD) if hasattr(self, post) else branch_BLD
        return constrain(x_BLD + branch_BLD, self.layout, RESIDUAL)

    def _attend(self, x_BLD, places, cache, kind):
        # Norms run on the residual layout (split along length in sequence-parallel mode); their
        # outputs are gathered to the tensor-parallel layout that attention and the MLP need.
        attn_BLD, cache = self.attn(constrain(self.attn_norm(x_BLD), self.layout, INNER), places, cache, kind)
        return self._join(x_BLD, attn_BLD, "attn_post_norm"), cache

    def __call__(self, x_BLD, places, cache=None, kind=None):
        """(x_BLD, this layer's updated KV cache, or None without one: see Attention; `kind`
        its LayerKind)."""
        x_BLD, cache = self._attend(x_BLD, places, cache, kind)
        mlp_BLD = self.mlp(constrain(self.mlp_norm(x_BLD), self.layout, INNER))
        return self._join(x_BLD, mlp_BLD, "mlp_post_norm"), cache


class MoEBlock(Block):
    """A block whose MLP is a mixture of experts; also returns the router's statistics."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        super().__init__(spec, rngs, moe=True)

    def __call__(self, x_BLD, places, cache=None, kind=None):
        """(x_BLD, updated KV cache or None, {name: scalar} router statistics)."""
        x_BLD, cache = self._attend(x_BLD, places, cache, kind)
        out_BLD, stats = self.mlp(constrain(self.mlp_norm(x_BLD), self.layout, INNER))
        return self._join(x_BLD, out_BLD, "mlp_post_norm"), cache, stats


class MoEStacks(nnx.Module):
    """An MoE model's layers: moe.first_dense dense blocks, then groups of moe.every_n_layers:
    n-1 dense blocks, then an MoE block.

    Up to three stacks, each with a leading 'layers' dimension: `first` ([first_dense, ...],
    absent when 0), `dense` ([groups*(n-1), ...], absent when n = 1) and `moe` ([groups, ...]);
    group g is dense layers g*(n-1) ... g*(n-1)+n-2, then MoE layer g.
    """

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        n, first = spec.moe.every_n_layers, spec.moe.first_dense
        groups = spec.moe.moe_layers(spec.num_layers)
        if first:
            self.first = _stacked(lambda r: Block(spec, r), first, rngs)
        if n > 1:
            self.dense = _stacked(lambda r: Block(spec, r), groups * (n - 1), rngs)
        self.moe = _stacked(lambda r: MoEBlock(spec, r), groups, rngs)


class Transformer(nnx.Module):
    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.spec = spec
        self.embed = normal(rngs, (spec.vocab_size, spec.d_model), ("vocab", "embed"), spec.init_std)
        if spec.arch.position == "learned":
            self.pos_embed = normal(rngs, (spec.max_seq_len, spec.d_model), ("position", "embed"), spec.init_std)
        if spec.moe.num_experts:
            self.layers = MoEStacks(spec, rngs)
        else:
            self.layers = _stacked(lambda r: Block(spec, r), spec.num_layers, rngs)
        self.final_norm = norm(spec)
        if not spec.tie_embeddings:
            self.head = normal(rngs, (spec.d_model, spec.vocab_size), ("embed", "vocab"), spec.init_std)
        if spec.mtp_depth:  # after the head: the model's own parameters draw as without them
            block = (lambda r: MoEBlock(spec, r)) if spec.moe.num_experts else (lambda r: Block(spec, r))
            self.mtp = _stacked(lambda r: prediction.Prediction(spec, r, block), spec.mtp_depth, rngs)

    def __call__(self, tokens_BL, places: Placement, cache=None):
        """(logits_BLV float32, the updated KV cache or None without one, the router statistics:
        {} for a dense model, else STATS averaged over the MoE layers).

        Without a cache: the training forward (causal over the sequence; pipeline and context
        parallel under an active layout). With one (models.decoding's stacks): decoding, the
        tokens at consecutive positions attend to everything cached before them.
        """
        x_BLD, cache, stats = self.hidden(tokens_BL, places, cache)
        return self.logits(x_BLD), cache, stats

    def hidden(self, tokens_BL, places: Placement, cache=None):
        """(the last layer's output x_BLD, before the final norm; the cache; the router
        statistics), as __call__ says."""
        x_BLD = self.embed_tokens(tokens_BL, places)
        stats = {}
        if self.spec.moe.num_experts:
            x_BLD, cache, stats = self._scan_groups(x_BLD, places, cache)
        elif cache is None:
            x_BLD = self._scan_layers(x_BLD, places)
        else:  # decoding: the unsharded model (LanguageModel.unsharded), no pipeline
            x_BLD, cache = self._loop(self.layers)(nnx.to_pure_dict(nnx.split(self.layers)[1]), x_BLD, places, cache)
        return x_BLD, cache, stats

    def embed_tokens(self, tokens_BL, places: Placement):
        """The residual stream's start: token embeddings (and learned positions), looked up
        where the table is stored (models.vocab: nothing gathers the table), times sqrt(d_model)
        where arch.embed_scale says."""
        tables = [(Table(self.embed[...], ("vocab", "embed")), tokens_BL)]
        if self.spec.arch.position == "learned":
            tables.append((Table(self.pos_embed[...], ("position", "embed")), places.positions))
        layout = self.spec.strategy.layout
        x_BLD = embed(tables, layout, self.spec.weights)
        if self.spec.arch.embed_scale:  # the factor rounded to the compute dtype, as Gemma's
            x_BLD = x_BLD * jnp.asarray(self.spec.d_model ** 0.5, x_BLD.dtype)
        return constrain(x_BLD, layout, RESIDUAL)

    def head_loss(self, x_BLD, targets_BL, final_norm=None, mask_BL=None, count=None, per_token: bool = False):
        """(mean next-token cross entropy, mean squared log-sum-exp: the z-loss) of the last
        layer's output x_BLD: the final norm (or `final_norm`: (its graphdef, params, stored
        dims)), the head and the loss in one vocabulary-parallel pass (models.vocab), no
        [tokens, V] logits; with mask_BL, over the tokens it keeps; with count, the sums over
        the targets that are not vocab.IGNORE divided by it. With per_token, each token's
        cross entropy [B, L] instead."""
        s = self.spec
        head = (Table(self.embed[...], ("vocab", "embed")) if s.tie_embeddings else
                Table(self.head[...], ("embed", "vocab"), transposed=True))
        if final_norm is None:
            norm_def, norm_state = nnx.split(self.final_norm)
            final_norm = (norm_def, nnx.to_pure_dict(norm_state), self._stored_dims(norm_state, stacked=False))
        norm_def, norm_params, norm_dims = final_norm
        prelude = (lambda params, x: nnx.merge(norm_def, params)(x), norm_params, norm_dims)
        return cross_entropy(x_BLD, head, targets_BL, s.strategy.layout, s.weights, s.head_chunk_mib, prelude,
                             s.final_logit_softcap, mask_BL, count, per_token)

    def logits(self, x_BLD):
        """Float32 logits [B, L, V] of the last layer's output: final norm, then the head (then
        the soft-cap, model.final_logit_softcap)."""
        x_BLD = constrain(self.final_norm(x_BLD), self.spec.strategy.layout, INNER)
        w_DV = (self.embed[...].T if self.spec.tie_embeddings else self.head[...]).astype(self.spec.dtype)
        logits_BLV = soft_cap(jnp.einsum("BLD,DV->BLV", x_BLD, w_DV, preferred_element_type=jnp.float32),
                              self.spec.final_logit_softcap)
        return constrain(logits_BLV, self.spec.strategy.layout, ("batch", "act_length", "act_vocab"))

    def stage_fn(self):
        """run(stacked layer params, x, places) -> x: a dense model's layers in order (a scan, or
        unrolled when spec.scan_layers is False; remat as set), each layer's weights gathered
        where it runs (parallel.fsdp): a pipeline stage's, or all of them."""
        loop = self._loop(self.layers, unroll=not self.spec.scan_layers)
        return lambda params, x_BLD, places: loop(params, x_BLD, places, None)[0]

    def _loop(self, stack: nnx.Module, unroll: bool = False):
        """run(stacked params, x_BLD, places, stacked cache or None) -> (x_BLD, the updated cache
        or None): the one layer loop. The layers of `stack` (stacked Blocks or MoEBlocks) in
        order, each through _layer (training: weights gathered where it runs, remat as set;
        decoding: its slice of the cache) as its LayerKind says, as a scan, or unrolled (`unroll`,
        training only). A layer pattern of period p > 1 scans groups of p layers, each group's
        layers written out with their own kinds, and runs the layers past the last whole group
        after it: each layer's attention is a program of its own kind, nothing chosen at run time."""
        graphdef, state = nnx.split(stack)
        dims, kinds = self._stored_dims(state), self.spec.layer_kinds
        p = len(kinds)

        def run(params, x_BLD, places, cache):
            def step(kind):
                def one(x, params_and_cache):
                    x, layer_cache, _ = self._layer(graphdef, dims, params_and_cache[0], x, places, params_and_cache[1],
                                                    kind)
                    return x, layer_cache
                return one

            def layers(x, params, caches, count: int, in_turn: bool = True):
                """`count` layers from the pattern's start, of these stacked params and caches
                ({stack: its kind's layers' caches, stacked} or None). Training `in_turn`, the
                layers run as a scan's iterations do (see _in_turn)."""
                taken, out = Counter(), {name: [] for name in caches or {}}
                for j in range(count):
                    kind = kinds[j % p]
                    layer_params = jax.tree.map(lambda a, j=j: a[j], params)
                    if caches is None and in_turn:
                        x = self._in_turn(graphdef, dims, kind, first=not j)(layer_params, x, places)
                        continue
                    name = decoding.stack_of(kind)
                    layer_cache = None if caches is None else jax.tree.map(lambda a, i=taken[name]: a[i], caches[name])
                    x, layer_cache = step(kind)(x, (layer_params, layer_cache))
                    if caches is not None:
                        out[name].append(layer_cache)
                        taken[name] += 1
                return x, None if caches is None else {name: jax.tree.map(lambda *c: jnp.stack(c), *cs)
                                                       for name, cs in out.items() if cs}

            count = jax.tree.leaves(params)[0].shape[0]
            if unroll and cache is None:
                return layers(x_BLD, params, None, count, in_turn=False)[0], None
            if p == 1:
                name = decoding.stack_of(kinds[0])
                x_BLD, out = jax.lax.scan(step(kinds[0]), x_BLD, (params, None if cache is None else cache[name]))
                return x_BLD, None if cache is None else {name: out}
            groups, per_group = count // p, Counter(decoding.stack_of(kind) for kind in kinds)

            whole, rest = periods.split(params, groups, p)
            caches = {name: periods.split(c, groups, per_group[name]) for name, c in (cache or {}).items()}
            whole_caches = None if cache is None else {name: c[0] for name, c in caches.items()}
            x_BLD, head = (jax.lax.scan(lambda x, xs: layers(x, *xs, p), x_BLD, (whole, whole_caches)) if groups
                           else (x_BLD, None))
            head = jax.tree.map(lambda c: c.reshape(-1, *c.shape[2:]), head)
            if count == groups * p:
                return x_BLD, head
            x_BLD, tail = layers(x_BLD, rest, None if cache is None else {n: c[1] for n, c in caches.items()},
                                 count - groups * p)
            return x_BLD, None if cache is None else periods.joined(head or {}, tail)

        return run

    def _run_layer(self, body, layer_params, dims, x_BLD, places, remat: bool = True):
        """body(params, x, places) -> (x, stats) on one layer's parameters, remat as set (or none)."""
        s = self.spec
        # Under context parallelism a dense layer maps over `sequence` too (its attention then
        # runs the ring on the map's manual axis); an MoE layer routes whole rows, so it does not.
        length = s.strategy.context != "none" and not s.moe.num_experts
        return fsdp.run(body, s.strategy.layout, s.weights, layer_params, dims, x_BLD, places,
                        self._remat if remat else lambda f: f, length)

    def _layer(self, graphdef, dims, params, x_BLD, places, cache, kind=None, remat: bool = True):
        """One layer (a Block or an MoEBlock) of LayerKind `kind` (None: the pattern's first):
        (x_BLD, its updated cache or None, router statistics); `remat` False: none, whatever
        model.remat says."""
        if cache is not None:
            return decoding.layer(graphdef, params, x_BLD, places, cache, self.spec.dtype, kind)

        def body(layer_params, x, places):
            out = nnx.merge(graphdef, layer_params)(x, places, None, kind)
            return out[0], out[2] if len(out) == 3 else {}

        x_BLD, stats = self._run_layer(body, params, dims, x_BLD, places, remat)
        return x_BLD, None, stats

    def _in_turn(self, graphdef, dims, kind, first: bool):
        """run(params, x, places) -> x: a dense layer of a period written out in a scan's body,
        kept in turn as a scan's iterations are. Left free, XLA gathers a whole period's weights
        at once, forward and backward (Gemma 3 12B on v5p-128: 26.2 GiB of temporaries a chip
        against 14.7 for a scan over one kind of layer). So the layer's weights wait for the
        previous layer's output (unless `first`), and under full remat its backward (a custom
        VJP that is the remat: the inputs saved, the forward run again) starts on them only once
        its output's cotangent exists: 15.8 GiB."""
        def layer(params, x, places, remat=True):
            return self._layer(graphdef, dims, params, x, places, None, kind, remat)[0]

        def run(params, x, places):
            if not first:
                x, params = jax.lax.optimization_barrier((x, params))
            return (periods.after_cotangent(layer) if self.spec.remat == "full" else layer)(params, x, places)

        return run

    def _stored_dims(self, state, stacked: bool = True) -> dict | None:
        """Where each parameter of `state` is stored and what a layer keeps of that (Layout.placed);
        of a stack of layers, less the layer dimension."""
        layout = self.spec.strategy.layout
        if layout is None:
            return None
        lead = ("layers",) if stacked else ()

        def placed(v):
            split, kept = layout.placed(lead + v.get_metadata()[AXES_KEY], v.shape)
            return Stored(split[len(lead):], kept[len(lead):])

        return _unflatten({path: placed(v) for path, v in nnx.to_flat_state(state)})

    def _remat(self, layer_fn):
        """layer_fn rematerialised in the backward pass as model.remat says (unchanged for 'none':
        a layer whose weights are gathered where it runs, parallel.fsdp, then keeps them from the
        forward for the backward; full and dots_saveable gather them again)."""
        if self.spec.remat == "none":
            return layer_fn
        return jax.checkpoint(layer_fn, policy=remat_policy(self.spec), prevent_cse=False)

    def _scan_layers(self, x_BLD, places):
        """The layers; under a pipeline, this is the forward-only pass (evaluation, inference):
        training runs the schedule's own executor (LanguageModel.loss)."""
        stacked = nnx.to_pure_dict(nnx.split(self.layers)[1])
        run_layers, s = self.stage_fn(), self.spec.strategy
        if s.pipeline != "none":
            return pipelined.forward(run_layers, stacked, x_BLD, places, s, self.spec.dtype)
        return run_layers(stacked, x_BLD, places)

    def _scan_groups(self, x_BLD, places, cache=None):
        """An MoE model's layers (see MoEStacks): the first dense layers, then the groups, scanned:
        (x_BLD, the updated cache or None, the router statistics averaged over the MoE layers).
        Remat, as set, per layer."""
        params, first = nnx.to_pure_dict(nnx.split(self.layers)[1]), self.spec.moe.first_dense
        head = None
        if first:
            head, cache = (None, None) if cache is None else (jax.tree.map(lambda c: c[:first], cache),
                                                              jax.tree.map(lambda c: c[first:], cache))
            x_BLD, head = self._loop(self.layers.first, unroll=not self.spec.scan_layers)(
                params["first"], x_BLD, places, head)
        x_BLD, cache, means, load_GX = self._groups()(params, x_BLD, places, cache)
        if head is not None:
            cache = jax.tree.map(lambda h, c: jnp.concatenate([h, c]), head, cache)
        return x_BLD, cache, self.router_stats(means, load_GX)

    def router_stats(self, means: dict, load_GX) -> dict:
        """The reported statistics of an MoE model: STATS' means over its MoE layers, MAX_LOAD
        and EXPERT_LOAD from each layer's load per expert (load_GX), and with balancing by bias
        the loads."""
        experts = load_GX.shape[-1]  # loads x experts: 1 is an even share
        stats = {**means, MAX_LOAD: jnp.mean(load_GX.max(-1)) * experts, EXPERT_LOAD: load_GX.mean(0) * experts}
        return {**stats, LOAD: load_GX} if self.spec.moe.bias_rate else stats

    def _groups(self):
        """run(the layers' params {'dense', 'moe'}, x_BLD, places, cache) -> (x_BLD, the updated
        cache or None, STATS summed over these MoE layers divided by the model's count of them,
        each MoE layer's load [groups, X]): the groups in order, each n-1 dense layers and an MoE
        layer, on whichever groups the parameters hold (all of them, or a pipeline stage's, whose
        shares the executor adds up over stages)."""
        n = self.spec.moe.every_n_layers
        model_groups = self.spec.moe.moe_layers(self.spec.num_layers)
        moe_def, moe_state = nnx.split(self.layers.moe)
        moe_dims = self._stored_dims(moe_state)
        dense_layers = self._loop(self.layers.dense) if n > 1 else None
        stack = decoding.stack_of(self.spec.layer_kinds[0])  # an MoE model's one kind of layer (models.checks)

        def run(params, x_BLD, places, cache):
            groups = jax.tree.leaves(params["moe"])[0].shape[0]
            dense_params = jax.tree.map(lambda p: p.reshape(groups, n - 1, *p.shape[1:]), params.get("dense"))
            caches = jax.tree.map(lambda c: c.reshape(groups, n, *c.shape[1:]), cache)

            def group(carry, xs):
                x, totals = carry
                dense_p, moe_p, group_cache = xs
                head = jax.tree.map(lambda c: c[:n - 1], group_cache)
                if n > 1:
                    x, head = dense_layers(dense_p, x, places, head)
                layer_cache = None if group_cache is None else jax.tree.map(lambda c: c[n - 1], group_cache[stack])
                x, tail, stats = self._layer(moe_def, moe_dims, moe_p, x, places, layer_cache)
                load = stats.pop(LOAD)
                group_cache = None if tail is None else jax.tree.map(lambda h, t: jnp.concatenate([h, t[None]]),
                                                                     head, {stack: tail})
                return (x, jax.tree.map(jnp.add, totals, stats)), (group_cache, load)

            zeros = {name: jnp.zeros((), jnp.float32) for name in STATS}
            (x_BLD, totals), (caches, load_GX) = jax.lax.scan(group, (x_BLD, zeros),
                                                              (dense_params, params["moe"], caches))
            means = {name: total / model_groups for name, total in totals.items()}
            return x_BLD, jax.tree.map(lambda c: c.reshape(-1, *c.shape[2:]), caches), means, load_GX

        return run


def _stacked(make_block, count: int, rngs: nnx.Rngs):
    """`count` blocks made by make_block(rngs), their parameters stacked on a leading 'layers' dimension."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return make_block(rngs)

    return make(rngs)


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
        self.axes = _unflatten({path: _axes_of(path, v) for path, v in flat})
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

    def loss(self, params: dict, inputs_BL, targets_BL, segments_BL=None, count=None):
        """(training objective, metrics): metrics['loss'] is the mean next-token cross entropy;
        an MoE model adds its router losses, weighted, to the objective and its router
        statistics (stat_names) to the metrics, and model.z_loss_weight the logits' z-loss.
        segments_BL as in apply_with_stats. With `count` (step.trained: a loss mask), targets
        that are vocab.IGNORE are not trained and the cross entropy is the sum over the others
        divided by count. With a context-parallel strategy, inputs, targets, positions and
        segments are reordered together (zig-zag), which leaves the function and the mean loss
        unchanged and saves putting the logits back in order."""
        (inputs_BL, targets_BL), places, _ = self._lay_out((inputs_BL, targets_BL), segments_BL)
        if self.spec.strategy.pipeline != "none" and self.spec.strategy.context == "none":
            return pipelined.loss(self, params, inputs_BL, targets_BL, places, count)
        return self._objective(*self._loss(params, inputs_BL, targets_BL, places, count))

    def token_losses(self, params: dict, inputs_BL, targets_BL, segments_BL=None):
        """(each target's cross entropy, float32 [B, L], the targets, the router's statistics), the
        tokens in the order the strategy computes in (a row's sums are the same in any order):
        the head's chunked vocabulary-parallel pass, no [B, L, V] logits. Not under a pipeline."""
        (inputs_BL, targets_BL), places, _ = self._lay_out((inputs_BL, targets_BL), segments_BL)
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

    def _lay_out(self, arrays_BL: tuple, segments_BL):
        """(arrays, Placement, order): token arrays in natural order, with their positions (from each
        document's start when segments are given), put in the order the strategy computes in:
        the zig-zag order of context parallelism (order), or as they are (order None)."""
        length = arrays_BL[0].shape[1]
        positions_BL = (jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), arrays_BL[0].shape)
                        if segments_BL is None else document_positions(segments_BL))
        s = self.spec.strategy
        if s.context == "none":
            return arrays_BL, Placement(positions_BL, segments_BL), None
        order = context.zigzag_order(length, s.mesh.shape[context.AXIS])
        arrays_BL, places = jax.tree.map(lambda x: x[:, order], (arrays_BL, Placement(positions_BL, segments_BL)))
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


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def model_from_config(config, platform: str, layout: Layout | None = None) -> tuple[LanguageModel, list[str]]:
    """The model for a run on `platform`, with the attention kernel resolved; notes say what was
    chosen. Given the run's layout, the model's strategy runs the pipeline schedule, context
    parallel attention and expert dispatch its mesh needs (see Strategy.for_layout)."""
    m = config.model
    impl, note = resolve_impl(m.attention.impl, platform, compute_dtype(m.dtype, platform), head_size(m),
                              config.data.document_mask, config.train.seq_len, config.train.deterministic,
                              m.attn_logit_softcap, m.mla.kv_lora_rank > 0)
    strategy = Strategy() if layout is None else Strategy.for_layout(
        layout, schedule=config.pipeline.schedule, microbatches=config.pipeline.microbatches,
        virtual_stages=config.pipeline.virtual_stages, context=m.attention.context_parallel,
        schedule_file=config.pipeline.schedule_file)
    one_cpu = _one_cpu_device(platform, layout)
    cpu_matmul = m.projections == "cpu" or (m.projections == "auto" and one_cpu)
    compiler = platform if layout is None else layout.mesh.devices.flat[0].platform  # CPU devices stand in for GPUs
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
