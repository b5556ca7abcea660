"""Decoder-only transformer in Flax NNX, built from its structure options (models.families:
Llama-style, GPT-2-style, ...), layers stacked and scanned.

This module holds the modules and the layer loop; decoding with a KV cache is models.decoding's,
the fit to a pipeline schedule models.pipelined's.

The rest of jaxscale sees the model through `LanguageModel` (models.language_model): parameters
are a plain nested dict of float32 arrays, and `axes` gives each one's logical axis names.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.kernels.flash import soft_cap
from jaxscale.models import decoding, lora, periods, pipelined, prediction
from jaxscale.models.attention import KEPT, Placement, layer_indices
from jaxscale.models.latent import LatentAttention
from jaxscale.models.layers import AXES_KEY, INNER, MLP, RESIDUAL, Attention, norm, normal, split_here
from jaxscale.models.moe import EXPERT_LOAD, LOAD, MAX_LOAD, STATS, MoE
from jaxscale.models.spec import ModelSpec
from jaxscale.models.vocab import Table, cross_entropy, embed
from jaxscale.parallel import fsdp
from jaxscale.sharding import Stored, constrain


def remat_policy(spec: ModelSpec):
    """model.remat's policy: `full` saves nothing inside a layer (it is all recomputed in the
    backward pass); `dots_saveable` keeps the matmuls' outputs (LoRA's wide last product aside,
    lora.DotsButTheAdapters) and the attention kernel's residuals (models.attention.KEPT)."""
    if spec.remat == "full":
        return None
    dots = lora.DotsButTheAdapters(spec.lora.rank) if spec.lora.on else jax.checkpoint_policies.dots_saveable
    return jax.checkpoint_policies.save_from_both_policies(dots, jax.checkpoint_policies.save_only_these_names(KEPT))



# Under sharding.overlap=all, the part of each layer's gradient reduce-scattered beside the next
# layer's backward pass (parallel.fsdp.scan_deferred); the attention's and the norms' are reduced in
# their own layer's. Llama-3-8B on v5p-256 at fsdp=128: the MLP's alone deferred, 3.39 GiB a chip
# and 8.1% of the bytes sent exposed; the whole layer's, 3.99 GiB and 8.8%; the attention's and the
# norms', 3.50 GiB and 8.0% (measured, docs/planning.md).
DEFERRED = ("mlp",)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with sandwich norms
    (arch.sandwich_norm) each branch's output is normed too before it joins the residual."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm, self.mlp_norm = norm(spec), norm(spec)
        if spec.arch.sandwich_norm:
            self.attn_post_norm, self.mlp_post_norm = norm(spec), norm(spec)
        self.attn = LatentAttention(spec, rngs) if spec.mla.on else Attention(spec, rngs)
        self.layout, self.spec = spec.strategy.layout, spec
        self.mlp = MoE(spec, rngs) if moe else MLP(spec, rngs)

    def _join(self, x_BLD, branch_BLD, post: str):
        """x + the branch's output (normed first by the post norm named `post`, if the block has it)."""
        branch_BLD = getattr(self, post)(branch_BLD) if hasattr(self, post) else branch_BLD
        return constrain(x_BLD + branch_BLD, self.layout, RESIDUAL)

    def _attend(self, x_BLD, places, cache, kind, split: bool):
        # Norms run on the residual layout (split along length in sequence-parallel mode); their
        # outputs are gathered to the tensor-parallel layout that attention and the MLP need, or
        # with collective matmuls (`split`: layers.split_here) chunk by chunk by the projections.
        if split:
            attn_BLD, cache = self.attn(self.attn_norm(x_BLD), places, cache, kind, split=True)
        else:
            attn_BLD, cache = self.attn(constrain(self.attn_norm(x_BLD), self.layout, INNER), places, cache, kind)
        return self._join(x_BLD, attn_BLD, "attn_post_norm"), cache

    def __call__(self, x_BLD, places, cache=None, kind=None):
        """(x_BLD, this layer's updated KV cache, or None without one: see Attention; `kind`
        its LayerKind)."""
        split = split_here(self.spec, cache)
        x_BLD, cache = self._attend(x_BLD, places, cache, kind, split)
        if split:
            mlp_BLD = self.mlp(self.mlp_norm(x_BLD), places.seeds, split=True)
        else:
            mlp_BLD = self.mlp(constrain(self.mlp_norm(x_BLD), self.layout, INNER), places.seeds)
        return self._join(x_BLD, mlp_BLD, "mlp_post_norm"), cache


class MoEBlock(Block):
    """A block whose MLP is a mixture of experts; also returns the router's statistics."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        super().__init__(spec, rngs, moe=True)

    def __call__(self, x_BLD, places, cache=None, kind=None):
        """(x_BLD, updated KV cache or None, {name: scalar} router statistics)."""
        x_BLD, cache = self._attend(x_BLD, places, cache, kind, split_here(self.spec, cache))
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
                             s.final_logit_softcap, mask_BL, count, per_token, s.strategy.overlap != "off")

    def logits(self, x_BLD):
        """Float32 logits [B, L, V] of the last layer's output: final norm, then the head (then
        the soft-cap, model.final_logit_softcap)."""
        x_BLD = constrain(self.final_norm(x_BLD), self.spec.strategy.layout, INNER)
        w_DV = (self.embed[...].T if self.spec.tie_embeddings else self.head[...]).astype(self.spec.dtype)
        logits_BLV = soft_cap(jnp.einsum("BLD,DV->BLV", x_BLD, w_DV, preferred_element_type=jnp.float32),
                              self.spec.final_logit_softcap)
        return constrain(logits_BLV, self.spec.strategy.layout, ("batch", "act_length", "act_vocab"))

    def stage_fn(self):
        """run(stacked layer params, x, places, chunk=0) -> x: a dense model's layers in order (a
        scan, or unrolled when spec.scan_layers is False; remat as set), each layer's weights
        gathered where it runs (parallel.fsdp): all of them, or pipeline chunk `chunk`'s (its
        index among the model's equal chunks of layers, which numbers its layers)."""
        loop = self._loop(self.layers, unroll=not self.spec.scan_layers)

        def run(params, x_BLD, places, chunk=0):
            first = chunk * jax.tree.leaves(params)[0].shape[0]
            return loop(params, x_BLD, places.at_layer(first), None)[0]

        return run

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
            def step(kind, places):
                def one(x, xs):  # xs: this layer's params, cache and index (None without dropout seeds)
                    layer_params, layer_cache, index = xs
                    x, layer_cache, _ = self._layer(graphdef, dims, layer_params, x, places.at_layer(index),
                                                    layer_cache, kind)
                    return x, layer_cache
                return one

            def layers(x, params, caches, count: int, places, in_turn: bool = True):
                """`count` layers from the pattern's start, of these stacked params and caches
                ({stack: its kind's layers' caches, stacked} or None), the first of them at
                `places`. Training `in_turn`, the layers run as a scan's iterations do (see _in_turn)."""
                taken, out = Counter(), {name: [] for name in caches or {}}
                for j in range(count):
                    kind = kinds[j % p]
                    layer_params = jax.tree.map(lambda a, j=j: a[j], params)
                    if caches is None and in_turn:
                        x = self._in_turn(graphdef, dims, kind, first=not j)(layer_params, x, places.at_layer(j))
                        continue
                    name = decoding.stack_of(kind)
                    layer_cache = None if caches is None else jax.tree.map(lambda a, i=taken[name]: a[i], caches[name])
                    x, layer_cache = step(kind, places)(x, (layer_params, layer_cache, j))
                    if caches is not None:
                        out[name].append(layer_cache)
                        taken[name] += 1
                return x, None if caches is None else {name: jax.tree.map(lambda *c: jnp.stack(c), *cs)
                                                       for name, cs in out.items() if cs}

            count = jax.tree.leaves(params)[0].shape[0]
            if unroll and cache is None:
                return layers(x_BLD, params, None, count, places, in_turn=False)[0], None
            if p == 1 and cache is None and self._deferred(dims):
                def body(layer_params, x, places):
                    return nnx.merge(graphdef, layer_params)(x, places, None, kinds[0])[0], {}
                s = self.spec
                return fsdp.scan_deferred(body, s.strategy.layout, s.weights, params, dims, x_BLD, places,
                                          layer_indices(places, count), deferred=DEFERRED), None
            if p == 1:
                name = decoding.stack_of(kinds[0])
                xs = (params, None if cache is None else cache[name], layer_indices(places, count))
                x_BLD, out = jax.lax.scan(step(kinds[0], places), x_BLD, xs)
                return x_BLD, None if cache is None else {name: out}
            groups, per_group = count // p, Counter(decoding.stack_of(kind) for kind in kinds)

            whole, rest = periods.split(params, groups, p)
            caches = {name: periods.split(c, groups, per_group[name]) for name, c in (cache or {}).items()}
            whole_caches = None if cache is None else {name: c[0] for name, c in caches.items()}

            def group(x, xs):  # a period's layers, the first at layer (group index) * p
                params, caches, first = xs
                return layers(x, params, caches, p, places.at_layer(first))

            x_BLD, head = (jax.lax.scan(group, x_BLD, (whole, whole_caches, layer_indices(places, groups, p))) if groups
                           else (x_BLD, None))
            head = jax.tree.map(lambda c: c.reshape(-1, *c.shape[2:]), head)
            if count == groups * p:
                return x_BLD, head
            x_BLD, tail = layers(x_BLD, rest, None if cache is None else {n: c[1] for n, c in caches.items()},
                                 count - groups * p, places.at_layer(groups * p))
            return x_BLD, None if cache is None else periods.joined(head or {}, tail)

        return run

    def _deferred(self, dims) -> bool:
        """Whether a scan of dense layers stored as `dims` reduce-scatters each layer's gradient
        during the next one's backward pass (Strategy.overlap "all"): under full remat, where the
        layer's gathers' transposes sum its gradients over all the devices its map splits the
        batch over (FSDP, ZeRO-3; not a data axis that leaves a sum to the map's edge); not with
        adapters or fp8 (state beside the weights)."""
        s = self.spec
        return (s.strategy.overlap == "all" and s.remat == "full" and not s.moe.num_experts and not s.lora.on
                and not s.fp8 and s.strategy.context == "none" and fsdp.reduced_in_loop(s.strategy.layout, dims))

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

        return unflatten({path: placed(v) for path, v in nnx.to_flat_state(state)})

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
        x_BLD, cache, means, load_GX = self._groups()(params, x_BLD, places.at_layer(first), cache)
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
                dense_p, moe_p, group_cache, first = xs
                at = places.at_layer(first)  # the group's first layer
                head = jax.tree.map(lambda c: c[:n - 1], group_cache)
                if n > 1:
                    x, head = dense_layers(dense_p, x, at, head)
                layer_cache = None if group_cache is None else jax.tree.map(lambda c: c[n - 1], group_cache[stack])
                x, tail, stats = self._layer(moe_def, moe_dims, moe_p, x, at.at_layer(n - 1), layer_cache)
                load = stats.pop(LOAD)
                group_cache = None if tail is None else jax.tree.map(lambda h, t: jnp.concatenate([h, t[None]]),
                                                                     head, {stack: tail})
                return (x, jax.tree.map(jnp.add, totals, stats)), (group_cache, load)

            zeros = {name: jnp.zeros((), jnp.float32) for name in STATS}
            (x_BLD, totals), (caches, load_GX) = jax.lax.scan(
                group, (x_BLD, zeros), (dense_params, params["moe"], caches, layer_indices(places, groups, n)))
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


def unflatten(flat: dict) -> dict:
    """The nested dict of a {path tuple: value} mapping."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
