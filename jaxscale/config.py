"""Config: the defaults every file starts from, loading, overrides, and one validate().

A config file is Python exposing ``get_config()`` that returns ``defaults()`` edited.
Overrides follow the absl ``config_flags`` convention: ``--config.train.steps=50``.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import math
from pathlib import Path

import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.guard import SPIKE_ACTIONS
from jaxscale.mesh import AXES, BATCH_AXES, axis_sizes
from jaxscale.sharding import DEFAULT_RULES, rules_from_config
from jaxscale.tracking import check_writers

FAMILIES = ("llama", "gpt2")
REMAT_POLICIES = ("none", "full", "dots_saveable")
DTYPES = ("auto", "float32", "bfloat16")
SOURCES = ("auto", "embedded", "synthetic", "file")
ATTENTION_IMPLS = ("xla", "cudnn", "auto")
CONTEXT_PARALLEL = ("ring", "all_gather")


def defaults() -> ml_collections.ConfigDict:
    """Every key jaxscale knows, with its default. Files and overrides may only edit these."""
    c = ml_collections.ConfigDict()
    c.model = dict(
        family="llama",        # llama: RMSNorm, RoPE, GQA, SwiGLU | gpt2: LayerNorm, learned positions, GELU
        num_layers=4, d_model=256, num_heads=4, num_kv_heads=4, d_ff=1024,
        vocab_size=256,        # >= the tokenizer's vocabulary
        max_seq_len=1024,      # gpt2: learned position table size
        tie_embeddings=True,   # share the input embedding with the output head
        rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
        dtype="auto",          # compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU. Parameters stay float32.
        remat="none",          # none | full | dots_saveable: what the backward pass recomputes per layer
        attention=dict(
            impl="auto",               # xla | cudnn | auto (cudnn where it runs, else xla)
            context_parallel="ring",   # ring | all_gather: attention when mesh.sequence > 1
        ),
        moe=dict(                      # mixture of experts; its experts are split over mesh.expert
            num_experts=0,             # experts per MoE layer; 0 = a dense model
            top_k=2,                   # experts each token goes to (softmax router, float32)
            capacity_factor=1.25,      # per sequence of L tokens each expert takes
                                       # min(L, ceil(factor * L * top_k / num_experts)); the rest is dropped
            every_n_layers=1,          # layers n, 2n, ... (from 1) are MoE, the others dense
            d_ff=0,                    # expert hidden size; 0 = model.d_ff
            aux_loss_weight=0.01,      # load-balancing loss (Switch/GShard) in the training loss
            z_loss_weight=0.001,       # router z-loss (mean logsumexp(logits)^2) in the training loss
        ),
    )
    c.mesh = {axis: 1 for axis in AXES}
    c.mesh.data = -1           # -1: the devices the other axes leave
    c.mesh_dcn = {axis: 1 for axis in AXES}  # multipliers across hosts/slices: data, pipeline, fsdp cross slow links
    c.zero_stage = 0           # also shard over `data`: 1 optimizer state, 2 + gradients, 3 + parameters
    c.pipeline = dict(
        microbatches=4,        # microbatches in flight through the stages when mesh.pipeline > 1 (>= mesh.pipeline)
        schedule="gpipe",      # gpipe | circular (interleaved: each microbatch passes the stages virtual_stages times)
        virtual_stages=1,      # layer chunks per device: 1 for gpipe, >= 2 for circular
    )
    c.sharding = dict(
        sequence_parallel=False,  # keep norms/residuals split along length over `tensor` between TP regions
        rules={name: ",".join(axes) for name, axes in DEFAULT_RULES.items()},  # logical axis -> mesh axes
    )
    c.train = dict(
        steps=1000, global_batch_size=32, seq_len=128,
        grad_accum_steps=1,    # microbatches per step, accumulated inside the jitted step
        seed=0, log_every=10,
        eval_every=100,        # 0 = never
        eval_batches=4,        # validation batches per evaluation
    )
    c.optim = dict(lr=3e-4, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1,
                   clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8)
    c.data = dict(
        source="auto",         # auto = file if data.path else embedded | embedded | synthetic | file
        path="",               # .txt, .jsonl, .parquet (text), .bin/.npy (pre-tokenized)
        tokenizer="bytes",     # bytes | path/to/tokenizer.json | tiktoken:NAME
        text_field="text", token_dtype="uint16", val_fraction=0.05, num_threads=2,
    )
    c.checkpoint = dict(
        every_steps=500,       # async save every N steps (0 = only at the end); always saved at the last step
        every_minutes=0.0,     # also save when this many minutes have passed since the last save (0 = off)
        max_to_keep=3,         # the newest committed checkpoints kept in WORKDIR/checkpoints
        keep_every=0,          # also keep, forever, every checkpoint whose step is a multiple of this (0 = off)
        resume_from="",        # when WORKDIR has no checkpoint: another run's workdir, checkpoints dir or step dir
                               # to continue (state and data position); "none" = never resume
        init_from="",          # when WORKDIR has no checkpoint: take only the parameters from this checkpoint
                               # (fine-tuning: fresh optimizer, step 0, data from the start)
        preemption_timeout_s=120.0,  # after SIGTERM/SIGINT, exit 1 if the final checkpoint has not committed by then
    )
    c.offload = dict(
        optimizer_state=False,   # keep Adam moments in pinned host memory between steps (ZeRO-Offload style)
        params=False,            # also the float32 master parameters
    )
    c.guard = dict(
        skip_nonfinite=True,   # a NaN/inf loss or gradient skips the update (inside the step; counted in metrics)
        spike_threshold=0.0,   # a loss this many std devs above the recent window's mean is a spike (0 = off)
        spike_window=100,      # recent losses the spike test compares against; it acts once the window is full
        spike_action="skip",   # skip: drop that update | rollback: reload the last checkpoint before the spike
                               # and continue with the batches after it
    )
    c.distributed = dict(
        coordinator_address="",     # host:port of process 0; empty = detect (launcher, Kubernetes, SLURM, MPI, TPU)
        num_processes=0,            # with coordinator_address: processes in the job
        process_id=-1,              # with coordinator_address: this process's index
        initialization_timeout_s=300,   # how long processes wait for each other to join
        heartbeat_timeout_s=100,        # the runtime declares a silent process dead after this and stops the job
        watchdog_seconds=600.0,     # no step completed for this long: dump every thread's stack, exit 1 (0 = off)
        straggler_every=100,        # every N steps compare processes' host time per step (0 = off)
        straggler_threshold=0.2,    # report a process slower than the median by more than this fraction
    )
    c.profile = dict(
        start_step=0,          # trace steps start_step .. start_step+steps-1 into WORKDIR/profile
        steps=0,               # 0 = no trace
    )
    c.xla = dict(
        gpu_defaults=True,     # set jaxscale's XLA flags on NVIDIA GPUs (jaxscale/xla_flags.py); yours win
    )
    c.tracking = dict(
        writers="jsonl,tensorboard",  # any of jsonl, tensorboard, mlflow, wandb (those two need their extras)
        experiment="jaxscale",   # MLflow experiment / W&B project
        run_name="",             # default: the workdir's name
        mlflow_uri="",           # default: sqlite:///WORKDIR/mlflow.db (MLflow's local store, no server)
        wandb_mode="",           # W&B's own setting (WANDB_MODE) unless online | offline | disabled
        report=True,             # refresh WORKDIR/report.md and its plots at every evaluation and at the end
    )
    c.metrics = dict(
        progress=True,         # a console line per logged step (and a bar on a terminal); notes and warnings always print
        peak_tflops=0.0,       # per-device dense peak for MFU; 0 = look the device up in the table
    )
    return c


def load(path: str) -> ml_collections.ConfigDict:
    """Run a config file's get_config(), or read a saved config.json (a workdir's, a converted
    model's); errors name --config."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--config", path, "pass a config file such as configs/tiny.py, or a run's config.json")
    if file.suffix == ".json":
        try:
            return from_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as error:
            raise ConfigError("--config", path, f"is not valid JSON ({error})") from None
    spec = importlib.util.spec_from_file_location(f"jaxscale_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config()
    except AttributeError as error:
        if "get_config" not in str(error):
            raise
        raise ConfigError("--config", path, "the file must define get_config() returning a ConfigDict") from None
    except (SyntaxError, ImportError, NameError) as error:
        raise ConfigError("--config", path, f"the file does not load ({type(error).__name__}: {error})") from None
    return config


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string, as with absl flags


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(choices))}"


def _coerce(field: str, old, new):
    """`new` converted to `old`'s type, or a ConfigError."""
    if isinstance(old, bool):
        if isinstance(new, bool):
            return new
    elif isinstance(old, int):
        if isinstance(new, int) and not isinstance(new, bool):
            return new
    elif isinstance(old, float):
        if isinstance(new, (int, float)) and not isinstance(new, bool):
            return float(new)
    elif isinstance(old, str):
        return str(new)
    else:
        return new
    raise ConfigError(field, new, f"expected {type(old).__name__} (like {old!r})")


def set_value(config, dotted: str, value) -> None:
    """Set config.<dotted> = value with the default's type; unknown keys are errors."""
    *parents, leaf = dotted.split(".")
    node = config
    for depth, name in enumerate(parents):
        if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
            raise ConfigError(dotted, value, f"unknown section '{name}'; {_suggest(name, node.keys())}")
        node = node[name]
    if leaf not in node:
        raise ConfigError(dotted, value, f"unknown key; {_suggest(leaf, node.keys())}")
    node[leaf] = _coerce(dotted, node[leaf], value)


def apply_overrides(config, overrides: list[str]) -> None:
    """Apply 'a.b=value' strings (the part after --config.)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--config.{key}", "", "overrides take the form --config.section.key=value")
        set_value(config, key, _parse_value(text))


def _check_keys(config, reference, prefix="") -> None:
    for key in config.keys():
        field = prefix + key
        if key not in reference:
            raise ConfigError(field, config[key], f"unknown key; {_suggest(key, reference.keys())}")
        if isinstance(reference[key], ml_collections.ConfigDict):
            _check_keys(config[key], reference[key], field + ".")
        else:
            _coerce(field, reference[key], config[key])


def _require(ok: bool, field: str, value, fix: str) -> None:
    if not ok:
        raise ConfigError(field, value, fix)


def _check_choices(c) -> None:
    for field, value, choices in (("model.family", c.model.family, FAMILIES),
                                  ("model.remat", c.model.remat, REMAT_POLICIES),
                                  ("model.dtype", c.model.dtype, DTYPES),
                                  ("data.source", c.data.source, SOURCES),
                                  ("model.attention.impl", c.model.attention.impl, ATTENTION_IMPLS),
                                  ("model.attention.context_parallel", c.model.attention.context_parallel,
                                   CONTEXT_PARALLEL),
                                  ("guard.spike_action", c.guard.spike_action, SPIKE_ACTIONS)):
        _require(value in choices, field, value, f"choose one of {', '.join(choices)}")


def _check_positive(c) -> None:
    for field in ("model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads",
                  "model.d_ff", "model.vocab_size", "model.max_seq_len", "train.steps",
                  "train.global_batch_size", "train.seq_len", "train.grad_accum_steps",
                  "train.log_every", "train.eval_batches", "optim.lr", "data.num_threads",
                  "pipeline.microbatches", "pipeline.virtual_stages", "checkpoint.max_to_keep",
                  "checkpoint.preemption_timeout_s", "guard.spike_window",
                  "distributed.initialization_timeout_s", "distributed.heartbeat_timeout_s"):
        section, key = field.split(".")
        _require(c[section][key] > 0, field, c[section][key], "must be > 0")
    for field in ("checkpoint.every_steps", "checkpoint.every_minutes", "checkpoint.keep_every",
                  "guard.spike_threshold", "distributed.watchdog_seconds", "distributed.straggler_every",
                  "distributed.straggler_threshold", "profile.start_step", "profile.steps", "train.eval_every", "optim.warmup_steps", "optim.weight_decay", "optim.clip_norm",
                  "optim.min_lr_ratio", "metrics.peak_tflops", "train.seed"):
        section, key = field.split(".")
        _require(c[section][key] >= 0, field, c[section][key], "must be >= 0")


def _check_model(m, seq_len: int) -> None:
    _require(m.d_model % m.num_heads == 0, "model.num_heads", m.num_heads,
             f"must divide model.d_model={m.d_model}")
    _require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
             f"must divide model.num_heads={m.num_heads} (grouped-query attention)")
    _require(m.family != "llama" or (m.d_model // m.num_heads) % 2 == 0, "model.num_heads", m.num_heads,
             f"RoPE needs an even head dimension; d_model/num_heads = {m.d_model // max(m.num_heads, 1)}")
    _require(m.family != "gpt2" or seq_len <= m.max_seq_len, "train.seq_len", seq_len,
             f"gpt2 learns positions up to model.max_seq_len={m.max_seq_len}; raise it or shorten seq_len")


# Logical axis -> the config field holding that dimension's size.
_DIMENSIONS = {"embed": "model.d_model", "heads": "model.num_heads", "kv_heads": "model.num_kv_heads",
               "mlp": "model.d_ff", "vocab": "model.vocab_size", "layers": "model.num_layers",
               "experts": "model.moe.num_experts"}


def _field(c, dotted: str):
    node = c
    for key in dotted.split("."):
        node = node[key]
    return node


def _check_rule_axes(rules) -> None:
    for name, axes in rules.items():
        for axis in axes:
            _require(axis in AXES, f"sharding.rules.{name}", ",".join(axes), f"'{axis}' is not a mesh axis; use {', '.join(AXES)}")


def _check_rules(c, rules, sizes) -> None:
    for name, field in _DIMENSIONS.items():
        parts = math.prod(sizes[a] for a in rules[name])
        _require(_field(c, field) % parts == 0, field, _field(c, field),
                 f"the '{name}' dimension is split {parts} ways ({'x'.join(f'{a}={sizes[a]}' for a in rules[name] if sizes[a] > 1)}); use a multiple of {parts} or change the mesh")
    parts = math.prod(sizes[a] for a in rules["length"])
    _require(c.train.seq_len % parts == 0, "train.seq_len", c.train.seq_len,
             f"activations are split {parts} ways along length; use a multiple of {parts}")


def _check_pipeline(c, sizes) -> None:
    stages, p = sizes["pipeline"], c.pipeline
    _require(p.schedule in ("gpipe", "circular"), "pipeline.schedule", p.schedule, "choose gpipe or circular")
    _require(p.schedule != "gpipe" or p.virtual_stages == 1, "pipeline.virtual_stages", p.virtual_stages,
             "gpipe runs one stage per device; set it to 1 or use pipeline.schedule=circular")
    _require(p.schedule != "circular" or p.virtual_stages > 1, "pipeline.virtual_stages", p.virtual_stages,
             "the circular schedule needs 2 or more layer chunks per device")
    if stages == 1:
        return
    chunks = stages * p.virtual_stages
    _require(c.model.num_layers % chunks == 0, "model.num_layers", c.model.num_layers,
             f"{stages} stages x {p.virtual_stages} virtual stages need a multiple of {chunks} layers")
    _require(p.microbatches >= stages, "pipeline.microbatches", p.microbatches,
             f"fewer microbatches than the {stages} stages leaves stages idle; use at least {stages}")
    micro = c.train.global_batch_size // c.train.grad_accum_steps
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    _require(micro % (p.microbatches * shards) == 0, "pipeline.microbatches", p.microbatches,
             f"each accumulation step's {micro} sequences must split into {p.microbatches} microbatches "
             f"over {shards} batch shards; make train.global_batch_size a multiple of "
             f"{p.microbatches * shards * c.train.grad_accum_steps}")


def _check_moe(c, sizes, rules) -> None:
    m, experts = c.model.moe, sizes["expert"]
    _require(m.num_experts >= 0, "model.moe.num_experts", m.num_experts, "must be >= 0 (0 = a dense model)")
    if not m.num_experts:
        _require(experts == 1, "mesh.expert", experts, "expert parallelism splits the experts of MoE layers; set "
                 f"model.moe.num_experts to a multiple of {experts}, or mesh.expert=1")
        return
    _require(1 <= m.top_k <= m.num_experts, "model.moe.top_k", m.top_k,
             f"must be between 1 and model.moe.num_experts={m.num_experts}")
    _require(m.capacity_factor > 0, "model.moe.capacity_factor", m.capacity_factor,
             "must be > 0 (0, dropless, is not implemented); a factor >= num_experts/top_k never drops a token")
    _require(m.every_n_layers >= 1 and c.model.num_layers % m.every_n_layers == 0, "model.moe.every_n_layers",
             m.every_n_layers, f"must be >= 1 and divide model.num_layers={c.model.num_layers}")
    for key in ("d_ff", "aux_loss_weight", "z_loss_weight"):
        _require(m[key] >= 0, f"model.moe.{key}", m[key], "must be >= 0" + (" (0 = model.d_ff)" if key == "d_ff" else ""))
    _require(sizes["pipeline"] == 1, "mesh.pipeline", sizes["pipeline"], "pipeline parallelism does not run "
             "mixture-of-experts layers; set mesh.pipeline=1 (or model.moe.num_experts=0)")
    hidden, parts = m.d_ff or c.model.d_ff, math.prod(sizes[a] for a in rules["mlp"])
    _require(hidden % parts == 0, "model.moe.d_ff", m.d_ff, f"the experts' hidden size ({hidden}) is split {parts} "
             f"ways ({'x'.join(f'{a}={sizes[a]}' for a in rules['mlp'] if sizes[a] > 1)}); use a multiple of {parts}")
    _require(experts == 1 or "expert" in rules["batch"], "sharding.rules.batch", ",".join(rules["batch"]),
             f"mesh.expert={experts} exchanges tokens within each expert group, so the batch must be split "
             "over expert too; add expert")


def _check_parallelism(c, device_count: int, granules: int) -> None:
    _require(c.mesh_dcn.tensor == 1, "mesh_dcn.tensor", c.mesh_dcn.tensor,
             "tensor parallelism communicates in every layer; keep it inside a host (mesh_dcn.tensor=1)")
    sizes = axis_sizes(c, device_count, granules)
    rules = rules_from_config(c, sizes)[0]
    _check_rule_axes(rules)
    _check_moe(c, sizes, rules)
    _check_pipeline(c, sizes)
    chunks = 2 * sizes["sequence"]
    _require(sizes["sequence"] == 1 or c.train.seq_len % chunks == 0, "train.seq_len", c.train.seq_len,
             f"context parallelism lays the sequence out in {chunks} chunks (2 x mesh.sequence); use a multiple of {chunks}")
    _require(0 <= c.zero_stage <= 3, "zero_stage", c.zero_stage, "choose 0, 1, 2 or 3")
    _check_rules(c, rules, sizes)
    shards = math.prod(sizes[axis] for axis in BATCH_AXES)
    t = c.train
    _require(t.global_batch_size % t.grad_accum_steps == 0, "train.grad_accum_steps", t.grad_accum_steps,
             f"must divide train.global_batch_size={t.global_batch_size}")
    micro = t.global_batch_size // t.grad_accum_steps
    _require(micro % shards == 0, "train.global_batch_size", t.global_batch_size,
             f"each microbatch ({micro} = {t.global_batch_size}/{t.grad_accum_steps} accumulation steps) must divide "
             f"evenly over {shards} batch shards (mesh data x fsdp x expert); use a multiple of {shards * t.grad_accum_steps}")


def validate(config, device_count: int, granules: int = 1) -> None:
    """Check everything before anything compiles; raise ConfigError naming field, value, fix.

    `granules` is the number of hosts (or TPU slices) the devices span.
    """
    _check_keys(config, defaults())
    _check_choices(config)
    _check_positive(config)
    _check_model(config.model, config.train.seq_len)
    _check_parallelism(config, device_count, granules)
    _require(0.0 < config.data.val_fraction < 1.0, "data.val_fraction", config.data.val_fraction,
             "must be between 0 and 1 (exclusive)")
    _require(config.data.source in ("auto", "file") or not config.data.path, "data.source", config.data.source,
             "data.path is set: use data.source=file (or auto), or clear data.path")
    _require(config.data.source != "file" or bool(config.data.path), "data.path", config.data.path,
             "data.source=file needs --config.data.path=FILE")
    _check_checkpoint_sources(config.checkpoint)
    _require(config.tracking.wandb_mode in ("", "online", "offline", "disabled"), "tracking.wandb_mode",
             config.tracking.wandb_mode, "choose online, offline or disabled (or leave it empty for W&B's default)")
    check_writers(config.tracking.writers)


def _check_checkpoint_sources(ckpt) -> None:
    _require(not (ckpt.init_from and ckpt.resume_from), "checkpoint.init_from", ckpt.init_from,
             f"checkpoint.resume_from={ckpt.resume_from!r} is set too; choose one (resume: state and data "
             "position; init: parameters only)")
    for field in ("resume_from", "init_from"):
        path = ckpt[field]
        if path and not (field == "resume_from" and path == "none"):
            _require(Path(path).exists(), f"checkpoint.{field}", path,
                     "no such path; give a workdir, its checkpoints/ dir or one step's dir")


def from_dict(values: dict, prefix: str = "") -> ml_collections.ConfigDict:
    """A config from a saved dict (config.json, a checkpoint's config): the defaults with every
    saved value set, so keys added to jaxscale since keep their defaults; unknown keys are errors."""
    config = defaults()
    for dotted, value in _flatten(values, prefix):
        set_value(config, dotted, value)
    return config


def _flatten(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def to_json(config) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
