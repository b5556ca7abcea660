"""The model under a pipeline: its training loss as the schedule's executor computes it, the
executor's stage function, and the forward-only pass (evaluation, inference) over the stages.

The pipeline's machinery is parallel.executor (training: forward and backward in one table)
and parallel.pipeline (the gpipe and circular forwards); this module fits the model's parts
to them: the embedding on the first stage, a stage's layers (and an MoE stage's router
statistics), the final norm, head and loss on the last.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxscale.models.layers import RESIDUAL
from jaxscale.models.moe import LOAD
from jaxscale.parallel import executor, pipeline
from jaxscale.sharding import constrain


def forward(run_layers, stacked: dict, x_BLD, places, strategy, dtype):
    """The layers' forward over the pipeline's stages (gpipe, or circular with virtual stages):
    run_layers(a stage's stacked params, x, places, chunk) -> x (chunk: the stage's index among
    the model's chunks of layers). The stages' weights cross the
    pipeline's map in the compute dtype."""
    stacked = jax.tree.map(lambda p: p.astype(dtype), stacked)
    if strategy.virtual_stages > 1:
        return pipeline.circular(run_layers, stacked, x_BLD, places, strategy.layout, strategy.microbatches,
                                 strategy.virtual_stages)
    return pipeline.gpipe(run_layers, stacked, x_BLD, places, strategy.layout, strategy.microbatches)


def stage_fn(model):
    """stage(a pipeline chunk's layer params, x, places, chunk) -> (x, statistics) of the
    Transformer `model`: its layers in order (chunk: the chunk's index among the model's equal
    chunks of layers, which numbers its layers); an MoE stage's groups add their STATS shares and
    loads (see Transformer._groups), for the executor to add up over stages."""
    if not model.spec.moe.num_experts:
        run_layers = model.stage_fn()
        return lambda params, x_BLD, places, chunk: (run_layers(params, x_BLD, places, chunk), {})
    run, n = model._groups(), model.spec.moe.every_n_layers

    def stage(params, x_BLD, places, chunk):
        first = model.spec.moe.first_dense + chunk * jax.tree.leaves(params["moe"])[0].shape[0] * n
        x_BLD, _, means, load_GX = run(params, x_BLD, places.at_layer(first), None)
        return x_BLD, {**means, LOAD: load_GX}

    return stage


def loss(lm, params: dict, inputs_BL, targets_BL, places, count=None):
    """(objective, metrics) of the LanguageModel `lm` as the pipeline schedule's executor
    computes them (forward and backward in one table, parallel.executor): the embedding on the
    first stage, the head and the loss on the last, an MoE stage's router losses differentiated
    where it runs. With context parallelism inside the stages the step differentiates the gpipe
    or circular forward instead (pipeline.check allows only those then, and no MoE layers): the
    executor's stages take different branches at a tick, and the ring's collective permutes
    inside them deadlocked XLA:CPU, whose permutes meet across all devices."""
    s = lm.spec.strategy
    params = jax.tree.map(lambda p: p.astype(lm.spec.dtype), params)  # the executor's map gathers them
    outer = {name: value for name, value in params.items() if name != "layers"}

    def model(outer):  # the layers' values are not read: their shapes stand in
        return nnx.merge(lm.graphdef, {**outer, "layers": lm.shapes["layers"]})

    def embed(outer, tokens_BL, places):
        return model(outer).embed_tokens(tokens_BL, places)

    def head_loss(outer, x_BLD, targets_BL, count):  # no z-loss under a pipeline (models.checks)
        return model(outer).head_loss(x_BLD, targets_BL, count=count)[0]

    def primal(stacked, outer, tokens_BL, targets_BL, places, count):
        return lm._objective(*lm._loss({**outer, "layers": stacked}, tokens_BL, targets_BL, places, count))

    def finish(loss, stats):  # the stages' statistics [P * V, ...], in layer order
        if not stats:
            return lm._objective(loss, {})
        load = stats.pop(LOAD)
        means = {name: value.sum(0) for name, value in stats.items()}
        return lm._objective(loss, model(outer).router_stats(means, load.reshape(-1, load.shape[-1])))

    fns = executor.Fns(embed, stage_fn(model(outer)), head_loss, lambda x_BLD: constrain(x_BLD, s.layout, RESIDUAL),
                       lm.extra_loss)
    def kept_of(names, shape):
        return s.layout.placed(names, shape.shape).kept

    kept = jax.tree.map(kept_of, lm.axes["layers"], lm.shapes["layers"],
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x))
    run = executor.pipelined_loss(s.table(), fns, primal, finish, s.layout, kept)  # each stage its own experts
    return run(params["layers"], outer, inputs_BL, targets_BL, places, count)
