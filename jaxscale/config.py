"""Config: the defaults every file starts from, loading, overrides, and key and type checks.

A config file is Python exposing ``get_config()`` that returns ``defaults()`` edited.
Overrides follow the absl ``config_flags`` convention: ``--config.train.steps=50``.
Checking values against each other and the devices is `jaxscale.validate.validate`'s job.

A leaf: this module imports no JAX (only errors and names), so loading and editing a config is
cheap and never initializes a backend.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
from pathlib import Path

import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.names import AXES, DEFAULT_RULES


def _rope_scaling() -> dict:
    """model.rope_scaling: RoPE extended past the pretrained context, as Hugging Face's rope_scaling."""
    return dict(
        type="none",               # none | linear | llama3 (Llama 3.1+) | yarn (Qwen's long context)
        factor=1.0,                # how many times the pretrained context the model reaches
        original_max_seq_len=8192,  # llama3, yarn: the context the model was pretrained on
        low_freq_factor=1.0, high_freq_factor=4.0,  # llama3: the band of wavelengths blended
        beta_fast=32.0, beta_slow=1.0,  # yarn: the rotations between which dimensions are blended
        attention_factor=0.0,      # yarn: sin and cos scaled by it; 0 = 0.1 ln(factor) + 1
        truncate=True,             # yarn: the blend's ends rounded out to whole dimensions
    )


def _latent_attention() -> dict:
    """model.mla: multi-head latent attention (DeepSeek-V2/V3, models/latent.py)."""
    return dict(
        kv_lora_rank=0,            # keys and values through a latent of this width (cached when decoding);
                                   # 0 = grouped-query attention
        q_lora_rank=0,             # queries through a latent of this width; 0 = a full-rank query projection
        rope_head_dim=64,          # each head's rotary part of the query and key (the key's shared by heads)
        nope_head_dim=128,         # each head's non-rotary part of the query and key
        v_head_dim=128,            # each head's value width
    )


def _adapters() -> dict:
    """model.lora: low-rank adapters trained on a frozen base (models/lora.py, docs/finetuning.md)."""
    return dict(
        rank=0,                    # each adapter's rank r; 0 = no adapters: every parameter trains
        alpha=16.0,                # the adapters' output scaled by alpha / r (PEFT's lora_alpha)
        targets="q,k,v,o,gate,up,down",  # the projections given adapters: attention's q, k, v, o and the
                                   # MLP's gate, up, down (GELU MLPs: in, out)
        base_dtype="float32",      # the frozen base's storage dtype: bfloat16 halves it
        dropout=0.0,               # PEFT's lora_dropout: each element of an adapter's input dropped
                                   # with this probability in training steps (0 = none)
    )


def _attention_kernels() -> dict:
    """model.attention: the attention kernel and context parallelism."""
    return dict(
        impl="auto",               # xla | cudnn | splash | auto (cudnn on GPU, splash on TPU, where they run)
        context_parallel="ring",   # ring | all_gather | ulysses: attention when mesh.sequence > 1
        block_size=512,            # the blockwise (xla) kernel's tile edge: memory O(L x block), not O(L^2)
    )


def _experts() -> dict:
    """model.moe: mixture of experts; its experts are split over mesh.expert."""
    return dict(
        num_experts=0,             # experts per MoE layer; 0 = a dense model
        top_k=2,                   # experts each token goes to (the router scores in float32)
        capacity_factor=1.25,      # per sequence of L tokens each expert takes
                                   # min(L, ceil(factor * L * top_k / num_experts)); the rest is dropped;
                                   # 0 = dropless (grouped matmuls, nothing padded; over mesh.expert
                                   # by ragged all-to-all)
        every_n_layers=1,          # layers n, 2n, ... (from 1) are MoE, the others dense
        first_dense=0,             # the first layers dense before them (DeepSeek-V3: 3, HF first_k_dense_replace);
                                   # the MoE spacing counts from the layer after them
        d_ff=0,                    # expert hidden size; 0 = model.d_ff
        num_shared=0,              # shared experts every token also goes through (DeepSeek-MoE):
                                   # one dense MLP of num_shared x d_ff hidden units beside the router's
        aux_loss_weight=0.01,      # load-balancing loss (Switch/GShard) in the training loss
        bias_rate=0.0,             # auxiliary-loss-free balancing (DeepSeek-V3): after each step every
                                   # expert's selection bias moves this much towards an even load; 0 = off
        selection_bias=False,      # the selection bias even with bias_rate 0, held as it is (an imported
                                   # DeepSeek-V3's e_score_correction_bias)
        z_loss_weight=0.001,       # router z-loss (mean logsumexp(logits)^2) in the training loss
        score="softmax",           # softmax | sigmoid: the router's scores (DeepSeek-V3: sigmoid of each logit)
        renormalize=True,          # top_k > 1: the chosen scores divided by their sum (HF norm_topk_prob);
                                   # False: the raw scores (some Qwen3-MoE checkpoints)
        expert_groups=1,           # group-limited routing (DeepSeek-V3, HF n_group): experts in this many
                                   # consecutive groups, each scored by the sum of its top-2 selection scores;
        top_groups=1,              # a token chooses only among its top_groups best groups (HF topk_group);
                                   # 1 and 1 (or top_groups=expert_groups): no limit
        routed_scale=1.0,          # combine weights x this (HF routed_scaling_factor; DeepSeek-V3: 2.5)
        hidden_chunk=0,            # dropless: each expert's hidden activations computed in slices of at most
                                   # this many columns, one after another (outputs summed in float32, each slice
                                   # recomputed for the backward pass); 0 = whole. Memory for time: the rows are
                                   # sized for the worst-case routing, and 1024 took 2.57 GiB a chip off Mixtral
                                   # 8x7B on v5p-256, but made an 8-expert step on one H200 1.48x as long
    )


def _add_model(c: ml_collections.ConfigDict) -> None:
    """The model: architecture, compute dtype, remat, attention and mixture of experts."""
    c.model = dict(
        family="llama",        # llama: RMSNorm, RoPE, GQA, SwiGLU | gpt2: LayerNorm, learned positions, GELU |
                               # mistral: llama's structure | qwen2: llama with biases on q, k, v |
                               # qwen3: llama with a norm over each query and key head |
                               # gemma2: (1 + w) RMSNorms before and after attention and the MLP, GeGLU, embeddings
                               # times sqrt(d_model) | gemma3: gemma2 with a norm over each query and key head |
                               # mixtral, qwen3_moe, deepseek_v3: llama's (qwen3's) structure, with model.moe's
                               # experts (deepseek_v3: and model.mla's latent attention)
        num_layers=4, d_model=256, num_heads=4, num_kv_heads=4, d_ff=1024,
        head_dim=0,            # each attention head's width; 0 = d_model / num_heads
        vocab_size=256,        # >= the tokenizer's vocabulary
        max_seq_len=1024,      # gpt2: learned position table size
        tie_embeddings=True,   # share the input embedding with the output head
        rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
        rope_scaling=_rope_scaling(),
        dtype="auto",          # compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU. Parameters stay float32.
        remat="none",          # none | full | dots_saveable: what the backward pass recomputes per layer
        layer_loop="auto",     # scan | unroll | auto (unroll up to 8 layers on one CPU device, else scan)
        projections="auto",    # einsum | cpu (XLA:CPU's fast backward, models/matmul.py) | auto (cpu on one CPU device)
        head_chunk_mib=256.0,  # the training loss runs over the vocabulary in chunks of at most this many MiB of
                               # float32 logits per device (models/vocab.py); 0 = the whole vocabulary at once
        z_loss_weight=0.0,     # + this x mean(logsumexp(logits)^2) in the objective (PaLM's z-loss; 1e-4 typical)
        mtp_depth=0,           # multi-token prediction modules after the model (DeepSeek-V3: 1): module k
                               # predicts the token k+1 places past the next (models/prediction.py)
        mtp_loss_weight=0.3,   # + this x their mean cross entropy in the objective (logged as mtp_loss)
        layer_pattern="G",     # each layer's attention, repeated over the layers: G global, L a sliding window
                               # (Gemma 2: LG, Gemma 3: LLLLLG; layer i takes character i mod the length)
        sliding_window=0,      # the L layers' window: each query sees itself and the window - 1 tokens before it
        local_rope_theta=0.0,  # the L layers' RoPE base, unscaled (Gemma 3: 10000); 0 = as the G layers
                               # (model.rope_theta and model.rope_scaling)
        query_scale=0.0,       # attention scores scaled by query_scale^-0.5 (HF's query_pre_attn_scalar);
                               # 0 = the head width
        attn_logit_softcap=0.0,   # attention scores s -> cap * tanh(s / cap) (Gemma 2: 50); 0 = none
        final_logit_softcap=0.0,  # logits z -> cap * tanh(z / cap) (Gemma 2: 30); 0 = none
        fp8=False,             # the layers' projections in fp8: e4m3 forward, e5m2 gradients, per-tensor scales
                               # of the step (models/fp8.py); NVIDIA compute capability 8.9+, emulated on CPU
        mla=_latent_attention(),
        lora=_adapters(),
        attention=_attention_kernels(),
        moe=_experts(),
    )


def _add_parallelism(c: ml_collections.ConfigDict) -> None:
    """How the model is split: the mesh, ZeRO, pipeline and sharding rules."""
    c.mesh = {axis: 1 for axis in AXES}
    c.mesh.data = -1           # -1: the devices the other axes leave
    c.mesh_dcn = {axis: 1 for axis in AXES}  # multipliers across hosts/slices: data, pipeline, fsdp cross slow links
    c.zero_stage = 0           # also shard over `data`: 1 optimizer state, 2 + gradients, 3 + parameters
    c.pipeline = dict(
        microbatches=4,        # microbatches in flight through the stages when mesh.pipeline > 1 (>= mesh.pipeline)
        schedule="1f1b",       # gpipe | 1f1b | zero_bubble (1 chunk a device) | circular | interleaved_1f1b
                               # (virtual_stages chunks) | file (schedule_file): see parallel/schedules.py
        virtual_stages=1,      # layer chunks per device: 1, or >= 2 for circular and interleaved_1f1b
        schedule_file="",      # with schedule=file: one line of actions per stage, e.g. "F0 F1 B0 F2 B1 B2"
    )
    c.sharding = dict(
        sequence_parallel=True,   # with mesh.tensor > 1: norms/residuals split along length over `tensor` between
                                  # tensor-parallel regions (Megatron's), where seq_len divides; False: whole
        overlap="auto",           # auto | off | head | all: FSDP collectives a step away from the compute that
                                  # needs them, so the compiler can run them beside other matmuls. head: the
                                  # loss's chunks of the head gathered a chunk ahead, their gradients
                                  # reduce-scattered a chunk behind (models/vocab.py). all: also, under
                                  # model.remat=full, each scanned layer's MLP gradients reduce-scattered during
                                  # the previous layer's backward, one layer's MLP gradient held meanwhile
                                  # (parallel/fsdp.py). auto: head on the TPU compiler, off elsewhere. Llama-3-8B
                                  # on v5p-256 at fsdp=128: 11.4% of the bytes sent exposed off, 8.7% head, 5.1%
                                  # all, for 0.04 and 0.09 GiB a chip more (docs/planning.md#what-the-schedule-hides)
        collective_matmul="auto",  # auto | on | off: with sequence parallelism, each dense layer's gathers and
                                   # reduce-scatters over `tensor` as ring steps beside its projections' partial
                                   # matmuls (parallel/collective_matmul.py). auto: on where the TPU compiler
                                   # compiles the step (it hides them there), off elsewhere (the GPU compiler's
                                   # schedule exposed more with them: docs/planning.md)
        rules={name: ",".join(axes) for name, axes in DEFAULT_RULES.items()},  # logical axis -> mesh axes
    )


def _add_training(c: ml_collections.ConfigDict) -> None:
    """The run: steps and batch, optimizer, data, checkpoints, offload, guards."""
    c.train = dict(
        steps=1000, global_batch_size=32, seq_len=128,
        grad_accum_steps=1,    # microbatches per step, accumulated inside the jitted step
        seed=0, log_every=10,
        deterministic=False,   # bit-reproducible steps: XLA's deterministic GPU ops, no cuDNN attention (README)
        eval_every=100,        # 0 = never
        eval_batches=4,        # validation batches per evaluation
    )
    c.optim = dict(lr=3e-4, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1,
                   clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8,
                   grad_reduce_dtype="")  # "" = the compute dtype on the wire | float32: gradients summed in fp32
    c.data = dict(
        source="auto",         # auto = file if data.path else embedded | embedded | synthetic | file
        path="",               # token stores (python -m jaxscale.prepare), .bin/.npy, or text: .txt/.md,
                               # .jsonl(.gz/.zst), .parquet, HF save_to_disk dirs; comma-separate files, dirs, globs
        mixture="",            # several weighted sources instead of path: web=STORE_A:0.7,code=STORE_B:0.3
        tokenizer="bytes",     # bytes | path/to/tokenizer.json | tiktoken:NAME
        text_field="text", token_dtype="uint16",  # uint16 | uint32: .bin files' token type
        val_fraction=0.05,     # the last 5% of tokens are held out for validation
        num_threads=2,         # reader threads; 0 reads in the training thread
        document_mask=False,   # packed documents attend only within themselves (split at the tokenizer's EOS id)
        # Chat records ({"messages": [...]} or {"prompt", "completion"}) in .jsonl/.parquet/save_to_disk files:
        chat_template="",      # "" = the tokenizer's own (beside data.tokenizer) | chatml | path/to/template.jinja
        train_on="assistant",  # all | assistant (every assistant turn) | completion (the last one): the loss mask
    )
    c.preference = dict(       # tuning on pairs of completions (data.path: prompt, chosen, rejected records)
        loss="none",           # none | dpo (TRL's sigmoid) | simpo (length-normalised, no reference)
        beta=0.1,              # DPO's beta (SimPO's paper: 2.0-2.5)
        gamma=0.5,             # SimPO's target reward margin
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
        local_every_steps=0,   # also keep each process's blocks (and a peer's) in host memory every N steps (0 = off);
                               # a restarted job resumes the newest such copy that is newer than the persistent one
        local_dir="",          # where those copies live: a local directory ({process}: the process index);
                               # "" = /dev/shm/jaxscale-USER/<workdir hash>, shared by the processes of a machine
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


def _add_operations(c: ml_collections.ConfigDict) -> None:
    """Around the run: processes, profiling, XLA flags, tracking and metrics."""
    c.distributed = dict(
        coordinator_address="",     # host:port of process 0; empty = detect (launcher, Kubernetes, SLURM, MPI, TPU)
        num_processes=0,            # with coordinator_address: processes in the job
        process_id=-1,              # with coordinator_address: this process's index
        initialization_timeout_s=300,   # how long processes wait for each other to join
        heartbeat_timeout_s=100,        # the runtime declares a silent process dead after this and stops the job
        watchdog_seconds=600.0,     # no step completed for this long: dump every thread's stack, exit 1 (0 = off)
        straggler_every=100,        # every N steps compare processes' host time per step (0 = off)
        straggler_threshold=0.2,    # report a process slower than the median by more than this fraction
        preflight=True,             # more than one process: check devices, collectives and the checkpoint dir first
    )
    c.profile = dict(
        start_step=0,          # trace steps start_step .. start_step+steps-1 into WORKDIR/profile
        steps=0,               # 0 = no trace
    )
    c.xla = dict(
        gpu_defaults=True,     # set jaxscale's XLA flags on NVIDIA GPUs (jaxscale/runtime/xla_flags.py); yours win
        tpu_defaults=True,     # compile TPU steps with reduce-scatters on the SparseCores and, without experts, the
                               # compiler's continuation fusions (same file); yours win
        cpu_defaults=True,     # on the CPU, glibc malloc keeps XLA:CPU's step buffers (jaxscale/runtime/cpu_malloc.py);
                               # any MALLOC_* you set wins
        compile_cache=True,    # a second start skips compiling (runtime/jax_cache.py) and tracing
                               # (runtime/program_cache.py)
        compile_cache_dir="",  # default: $JAXSCALE_COMPILE_CACHE_DIR, else ~/.cache/jaxscale/xla; "off" = no cache
    )
    c.tracking = dict(
        writers="jsonl,tensorboard",  # any of jsonl, tensorboard, mlflow, wandb (those two need their extras)
        experiment="jaxscale",   # MLflow experiment / W&B project
        run_name="",             # default: the workdir's name
        mlflow_uri="",           # default: sqlite:///WORKDIR/mlflow.db (MLflow's local store, no server)
        wandb_mode="",           # W&B's own setting (WANDB_MODE) unless online | offline | disabled
        report=True,             # write WORKDIR/report.md and its plots at the end of the run, and refresh them
        report_every_minutes=10.0,  # at an evaluation when this long has passed since the last (0 = at every one)
    )
    c.metrics = dict(
        progress=True,         # a console line per logged step (and a bar on a terminal);
                               # notes and warnings always print
        peak_tflops=0.0,       # per-device dense peak for MFU; 0 = look the device up in the table
    )


def defaults() -> ml_collections.ConfigDict:
    """Every key jaxscale knows, with its default: the one place defaults live. Files and
    overrides may only edit these."""
    c = ml_collections.ConfigDict()
    _add_model(c)
    _add_parallelism(c)
    _add_training(c)
    _add_operations(c)
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
    for _, name in enumerate(parents):
        if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
            raise ConfigError(dotted, value, f"unknown section '{name}'; {_suggest(name, node.keys())}")
        node = node[name]
    if leaf not in node:
        raise ConfigError(dotted, value, f"unknown key; {_suggest(leaf, node.keys())}")
    node[leaf] = _coerce(dotted, node[leaf], value)


# How absl and ml_collections users write booleans on a command line; any case.
BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _current(config, dotted: str):
    """config.<dotted>'s value, or None where the key does not exist (set_value then says so)."""
    node = config
    for name in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or name not in node:
            return None
        node = node[name]
    return node


def parse_bool(text: str) -> bool | None:
    """A boolean as a command line writes it (BOOL_WORDS, any case), None for any other word."""
    return BOOL_WORDS.get(text.strip().lower())


def _override_value(config, key: str, text: str):
    """An override's text as a value: a Python literal, else the bare word as a string; for a
    boolean key true/false, yes/no or 1/0 in any case, else a ConfigError."""
    if isinstance(_current(config, key), bool):
        if (value := parse_bool(text)) is None:
            raise ConfigError(key, text, "expected bool: write true or false (yes/no and 1/0 work too)")
        return value
    return _parse_value(text)


def apply_overrides(config, overrides: list[str]) -> None:
    """Apply 'a.b=value' strings (the part after --config.).

    data.path or data.mixture given here without data.source means the file source: it replaces
    the source the config file chose (configs/llama_1b.py's synthetic tokens train on
    --config.data.path=FILE). A data.source given beside it stands, and data.settings.check
    refuses a source that reads no files with a path.
    """
    keys = set()
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--config.{key}", "", "overrides take the form --config.section.key=value")
        set_value(config, key, _override_value(config, key, text))
        keys.add(key)
    if keys & {"data.path", "data.mixture"} and "data.source" not in keys:
        _files_given(config.data)


def _files_given(data) -> None:
    """A source that reads no files (synthetic, embedded) gives way to the files just given."""
    if (data.path or data.mixture) and data.source not in ("auto", "file"):
        data.source = "file"


def check_keys(config) -> None:
    """Every key of `config` is one of defaults()' and every value has its default's type
    (ints pass as floats); else a ConfigError naming the first bad field."""
    _check_keys(config, defaults(), "")


def _check_keys(config, reference, prefix: str) -> None:
    for key in config.keys():
        field = prefix + key
        if key not in reference:
            raise ConfigError(field, config[key], f"unknown key; {_suggest(key, reference.keys())}")
        if isinstance(reference[key], ml_collections.ConfigDict):
            _check_keys(config[key], reference[key], field + ".")
        else:
            _coerce(field, reference[key], config[key])


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
