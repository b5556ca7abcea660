"""Pipeline parallelism over the `pipeline` mesh axis: the settings' checks, and the forward
passes of the GPipe and circular orders as one scan.

Training runs the schedule's table (parallel.schedules) in parallel.executor, forward and
backward together. The forward passes here serve what is not differentiated (evaluation,
inference) and, with context parallelism inside the stages (mesh.sequence > 1), training by
autodiff through them (only gpipe and circular then).

The stacked layer parameters keep their one layout, the `layers` dimension split over
`pipeline`, so each device's contiguous block of layers is its stage whatever P is. Inside
shard_map over `pipeline` (and the batch's axes, see `_over_stages`), M microbatches flow
through the P stages in M+P-1 ticks: at each tick every stage runs its layers on what it holds
and passes the result to the next stage with a collective permute. The first stage takes
microbatch t at tick t; the last stage's outputs are collected and summed over the axis (only
it contributes), so every stage continues with the same activations. Differentiated, the scan
keeps every microbatch's stage input (memory grows with M).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale import sharding
from jaxscale.errors import ConfigError, require, require_positive
from jaxscale.names import PIPELINE_SCHEDULES
from jaxscale.parallel import microbatch, schedules

AXIS = "pipeline"
ONE_CHUNK = ("gpipe", "1f1b", "zero_bubble")
INTERLEAVED = ("circular", "interleaved_1f1b")


def check(config, sizes) -> None:
    """The `pipeline` settings name a schedule and, with `sizes[AXIS]` > 1 stages, fit the layers
    and the batch; raises ConfigError naming the field to change."""
    p = config.pipeline
    require_positive(config, ("pipeline.microbatches", "pipeline.virtual_stages"))
    require(p.schedule in PIPELINE_SCHEDULES, "pipeline.schedule", p.schedule,
            f"choose one of {', '.join(PIPELINE_SCHEDULES)}")
    require(p.schedule not in ONE_CHUNK or p.virtual_stages == 1, "pipeline.virtual_stages", p.virtual_stages,
            f"{p.schedule} runs one layer chunk per device; set it to 1 or use pipeline.schedule=interleaved_1f1b")
    require(p.schedule not in INTERLEAVED or p.virtual_stages > 1, "pipeline.virtual_stages", p.virtual_stages,
            f"the {p.schedule} schedule needs 2 or more layer chunks per device")
    require(p.schedule != "file" or bool(p.schedule_file), "pipeline.schedule_file", p.schedule_file,
            "pipeline.schedule=file needs the path of a schedule file (one line of actions per stage)")
    if sizes[AXIS] > 1:
        _check_stages(config, sizes)
        require(sizes["sequence"] == 1 or p.schedule in ("gpipe", "circular"), "pipeline.schedule", p.schedule,
                "with mesh.sequence > 1 the stages run by autodiff through the gpipe or circular forward "
                "(the schedule executor does not take context parallelism yet); choose gpipe or circular")
        require(sizes["sequence"] > 1 or not config.model.z_loss_weight, "model.z_loss_weight",
                config.model.z_loss_weight, "the pipeline's schedule executor differentiates the cross entropy "
                "alone; set it to 0 or run without mesh.pipeline")
        if p.schedule == "file":
            try:
                schedules.load(p.schedule_file, sizes[AXIS], p.microbatches, p.virtual_stages)
            except (OSError, schedules.ScheduleError) as error:
                raise ConfigError("pipeline.schedule_file", p.schedule_file, str(error)) from None


def _check_stages(config, sizes) -> None:
    """Every stage gets whole layer chunks, and every stage has a microbatch to work on."""
    p, t, stages = config.pipeline, config.train, sizes[AXIS]
    chunks = stages * p.virtual_stages
    require(config.model.num_layers % chunks == 0, "model.num_layers", config.model.num_layers,
            f"{stages} stages x {p.virtual_stages} virtual stages need a multiple of {chunks} layers")
    require(p.microbatches >= stages, "pipeline.microbatches", p.microbatches,
            f"fewer microbatches than the {stages} stages leaves stages idle; use at least {stages}")
    micro, shards = t.global_batch_size // t.grad_accum_steps, sharding.batch_shards(config, sizes)[0]
    require(micro % (p.microbatches * shards) == 0, "pipeline.microbatches", p.microbatches,
            f"each accumulation step's {micro} sequences must split into {p.microbatches} microbatches "
            f"over {shards} batch shards; make train.global_batch_size a multiple of "
            f"{p.microbatches * shards * t.grad_accum_steps}")


def _take(tree, index):
    """Microbatch `index` of each array in tree (the tokens' positions and segment ids)."""
    return jax.tree.map(lambda x: x[index], tree)


def _schedule(stage_fn, stages: int, count: int):
    """The per-device GPipe loop, run inside shard_map over `pipeline`."""
    def local(params, xs, places):
        stage, last = jax.lax.axis_index(AXIS), stages - 1
        forward = [(i, i + 1) for i in range(stages - 1)]

        def tick(carry, t):
            held, outputs = carry
            inp = jnp.where(stage == 0, xs[jnp.minimum(t, count - 1)], held)
            out = stage_fn(params, inp, _take(places, jnp.clip(t - stage, 0, count - 1)), stage)
            slot = jnp.maximum(t - last, 0)
            ready = (stage == last) & (t >= last)
            outputs = outputs.at[slot].set(jnp.where(ready, out, outputs[slot]))  # touches one slot
            return (jax.lax.ppermute(out, AXIS, forward), outputs), None

        start = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs))
        (_, outputs), _ = jax.lax.scan(tick, start, jnp.arange(count + stages - 1))
        return outputs

    return local


def gpipe(stage_fn, stacked_params, x_BLD, places, layout, microbatches: int):
    """x after all layers, run as `layout.mesh.shape['pipeline']` stages over `microbatches` microbatches.

    stage_fn(local_params, x, places, stage) applies one stage's layers (places: the tokens'
    positions, a pytree of [B, L] arrays microbatched as x is; stage: its index); stacked_params
    has the layer dimension first, split over `pipeline`.
    """
    stages = layout.mesh.shape[AXIS]
    local = _schedule(jax.checkpoint(stage_fn), stages, microbatches)  # remat per stage
    return _over_stages(local, P(AXIS), stacked_params, x_BLD, places, layout, microbatches)


def _over_stages(local, param_spec, params, x_BLD, places, layout, microbatches: int):
    """Run a schedule in shard_map over `pipeline` on the microbatches of x; its outputs (held
    by the last stage, zeros elsewhere) are summed over the stages.

    The batch's own axes (data, fsdp, expert as the layout splits rows) are manual in the map
    too: each device keeps its rows through every tick, and the stage weights, whole over those
    axes inside, are gathered once on the way in and their gradients summed once on the way out.
    Left automatic, the partitioner summed each tick's weight gradients over `data` inside the
    loop (M+P-1 times a step; 4.4x the bytes of one sum on 4 microbatches, measured) and
    gathered fsdp-split weights at every tick.

    On CPU, bfloat16 crosses the boundary as float32: XLA:CPU's all-reduce promotion pass aborts
    the process ("Invalid binary instruction opcode copy") on the bfloat16 all-reduces of this
    partly manual shard_map: the outputs' sum, the inputs' and the weights' gradients.
    """
    if x_BLD.shape[0] % microbatches:
        raise ValueError(f"pipeline: a batch of {x_BLD.shape[0]} rows does not split into {microbatches} microbatches; "
                         "pass a multiple of them, or call model.unsharded() for one program at any batch size")
    dtype = x_BLD.dtype
    cpu_bf16 = layout.reduces_in_float32(dtype)

    def wire(tree, to=jnp.float32):
        return jax.tree.map(lambda x: x.astype(to) if cpu_bf16 and x.dtype in (jnp.float32, jnp.bfloat16) else x, tree)

    def body(params, xs, places):
        out = local(wire(params, dtype), xs.astype(dtype), places)
        return jax.lax.psum(wire(out), AXIS)

    xs, places = microbatch.split(x_BLD, microbatches), microbatch.split_tree(places, microbatches)
    batch = layout.batch_axes(AXIS)
    rows = P(None, batch or None)
    out = jax.shard_map(body, mesh=layout.mesh_here(), in_specs=(param_spec, rows, rows), out_specs=rows,
                        axis_names={AXIS, *batch}, check_vma=False)(wire(params), wire(xs), places)
    return microbatch.merge(out).astype(dtype)


def _circular_schedule(stage_fn, stages: int, count: int, repeats: int):
    """The per-device circular loop: each microbatch passes the ring of stages `repeats` times.

    Stage p at tick t works on microbatch (t-p) mod M in round (t-p) // M with its round's layer
    chunk. What leaves the last stage comes back to stage 0, which parks it until its turn
    (needs M >= P); outputs are taken from the last stage in the final round.
    """
    def local(params, xs, places):
        stage, last, total = jax.lax.axis_index(AXIS), stages - 1, count * repeats
        ring = [(i, (i + 1) % stages) for i in range(stages)]

        def tick(carry, t):
            held, parked, outputs = carry
            parked = parked.at[(t - stages) % count].set(held)  # stage 0 keeps what came round
            fresh = xs[jnp.minimum(t, count - 1)]
            inp = jnp.where(stage == 0, jnp.where(t < count, fresh, parked[t % count]), held)
            work = jnp.clip(t - stage, 0, total - 1)
            chunk = jax.tree.map(lambda p: p[work // count], params)
            out = stage_fn(chunk, inp, _take(places, work % count), (work // count) * stages + stage)
            slot = jnp.clip(t - last - (repeats - 1) * count, 0, count - 1)
            ready = (stage == last) & (t - last >= (repeats - 1) * count)
            outputs = outputs.at[slot].set(jnp.where(ready, out, outputs[slot]))
            return (jax.lax.ppermute(out, AXIS, ring), parked, outputs), None

        start = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs), jnp.zeros_like(xs))
        (_, _, outputs), _ = jax.lax.scan(tick, start, jnp.arange(total + stages - 1))
        return outputs

    return local


def circular(stage_fn, stacked_params, x_BLD, places, layout, microbatches: int, repeats: int):
    """The circular (interleaved) schedule: layer chunk v*P+p runs on device p in round v.

    Parameters are stored in their one layout (layers split contiguously over `pipeline`); the
    step regroups them [V, P, L/(PV)] with the P dimension on `pipeline`, one all-to-all of the
    layer weights per step, and the gradients take the reverse path.
    """
    stages = layout.mesh.shape[AXIS]

    def regroup(p):
        p = p.reshape(repeats, stages, p.shape[0] // (repeats * stages), *p.shape[1:])
        return sharding.constrain(p, layout, P(None, AXIS))

    grouped = jax.tree.map(regroup, stacked_params)
    local = _circular_schedule(jax.checkpoint(stage_fn), stages, microbatches, repeats)

    def squeeze(params, xs, pos):
        return local(jax.tree.map(lambda p: p[:, 0], params), xs, pos)

    return _over_stages(squeeze, P(None, AXIS), grouped, x_BLD, places, layout, microbatches)
