"""Hugging Face import/export: logits match transformers' (fp32, CPU) both ways.

Models are tiny and randomly initialised here (no downloads). Every parameter, norm scales and
biases included, is perturbed away from its initial value so that a swapped or misplaced
tensor changes the logits. Logits are compared with an absolute tolerance of 1e-4 (rtol 0);
they are of order 1-5 here.
"""

import dataclasses
import json
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import LazyModule, build_for, make_layout
from jaxscale import sharding as shd
from jaxscale.errors import ConfigError
from jaxscale.interop import load_hf_params, model_config_from_hf, save_hf
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.models.latent import LatentSpec
from jaxscale.models.moe import MoESpec
from jaxscale.models.rope import RopeScaling
from jaxscale.state import param_specs

torch = LazyModule("torch")
transformers = LazyModule("transformers")

ATOL = 1e-4
VOCAB = 100
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))


def _llama(tied: bool, **rope):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0,
                                      rms_norm_eps=1e-5, tie_word_embeddings=tied, max_position_embeddings=512, **rope)
    return transformers.LlamaForCausalLM(config)


# Scaled RoPE as Llama 3.1+ (llama3), linear interpolation and YaRN checkpoints carry it. At
# head_dim 16, theta 5e4 and a pretrained context of 64, the wavelengths (6.3 to 75k positions)
# fall in every band: llama3 keeps 6.3, blends 24 and divides the rest by the factor; YaRN keeps
# dimension 0, blends 1 and interpolates the rest.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _built_as_llama(config_class, model_class, tied: bool = False, **fields):
    """A Llama-structured family (Mistral without a window, Qwen2 with its q, k, v biases)."""
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=tied, **fields)
    return model_class(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


# Gemma at sizes where each option shows: windows of 5 and 4 tokens of 16, scores soft-capped at 2
# and logits at 8 (both of order 1-5 here), a query scale of 24 on 16-wide heads; Gemma 3 with its
# two RoPEs (the global one scaled) and three layers, so that its pattern (LG) leaves one over.
def _gemma2():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=2.0,
        final_logit_softcapping=8.0, rope_theta=5e4, attn_implementation="eager")  # sdpa cannot soft-cap
    return transformers.Gemma2ForCausalLM(config)


def _gemma3():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}}
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], attn_implementation="eager")
    return transformers.Gemma3ForCausalLM(config)


def _gemma3_with_vision():
    """Gemma 3 as the 4B and larger checkpoints are: the text model beside a vision encoder."""
    text = _gemma3().config.to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       attn_implementation="eager")
    return transformers.Gemma3ForConditionalGeneration(config)


# Mixtures of experts, dropless as transformers computes them: Mixtral with experts in every
# layer and its top-2 weights renormalised; Qwen3-MoE with an MoE layer every second layer (0 and
# 2 dense, 1 and 3 MoE: the two stacks map back to HF's layer numbers) and its top-2
# probabilities as they are (norm_topk_prob false).
def _mixtral():
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rope_theta=5e4, rms_norm_eps=1e-5)
    return transformers.MixtralForCausalLM(config)


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, norm_topk_prob=False, rope_theta=5e4, rms_norm_eps=1e-5)
    return transformers.Qwen3MoeForCausalLM(config)


# DeepSeek-V3: latent attention (a query latent too), one dense layer first, then two MoE layers of
# 8 sigmoid-scored experts in 4 groups (a token's 2 experts from its 2 best groups), a shared
# expert, and a correction bias set away from its zeros so that it changes the choice; the rotary
# dimensions interleaved as DeepSeek stores them.
def _deepseek_v3():
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, rms_norm_eps=1e-5, max_position_embeddings=128)
    model = transformers.DeepseekV3ForCausalLM(config)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


HF_MODELS = {"llama_gqa_untied": lambda: _llama(False), "llama_tied": lambda: _llama(True), "gpt2": _gpt2,
             "llama3_rope": lambda: _llama(False, rope_scaling=dict(LLAMA3_ROPE)),  # a copy: HF adds to it
             "linear_rope": lambda: _llama(True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
             "yarn_rope": lambda: _llama(False, rope_scaling=dict(YARN_ROPE)),
             "mistral": lambda: _built_as_llama(transformers.MistralConfig, transformers.MistralForCausalLM,
                                                sliding_window=None),
             "qwen2": lambda: _built_as_llama(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tied=True),
             # heads twice hidden_size / num_attention_heads wide, as Qwen3-0.6B's and -4B's are
             "qwen3": lambda: _built_as_llama(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, tied=True,
                                              head_dim=32),
             "mistral_window": lambda: _built_as_llama(transformers.MistralConfig, transformers.MistralForCausalLM,
                                                       sliding_window=6, attn_implementation="eager"),
             "gemma2": _gemma2, "gemma3": _gemma3, "gemma3_with_vision": _gemma3_with_vision,
             "mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}

SPECS = {
    "llama_gqa_untied": ModelSpec(family="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                                  vocab_size=VOCAB, tie_embeddings=False, rope_theta=50000.0),
    "gpt2_tied": ModelSpec(family="gpt2", num_layers=2, d_model=64, num_heads=4, num_kv_heads=4, d_ff=256,
                           vocab_size=VOCAB, max_seq_len=32),
    "llama3_rope": ModelSpec(family="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                             vocab_size=VOCAB, tie_embeddings=False, rope_theta=50000.0, max_seq_len=512,
                             rope_scaling=dict(type="llama3", factor=8.0, original_max_seq_len=64)),
    "yarn_rope": ModelSpec(family="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                           vocab_size=VOCAB, rope_theta=50000.0, max_seq_len=512,
                           rope_scaling=dict(type="yarn", factor=4.0, original_max_seq_len=64)),
    "mistral": ModelSpec(family="mistral", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                         vocab_size=VOCAB, tie_embeddings=False, rope_theta=50000.0),
    "qwen2": ModelSpec(family="qwen2", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                       vocab_size=VOCAB, rope_theta=50000.0),
    "qwen3": ModelSpec(family="qwen3", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=32, d_ff=128,
                       vocab_size=VOCAB, rope_theta=50000.0),
    "gemma2": ModelSpec(family="gemma2", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                        vocab_size=VOCAB, rope_theta=5e4, layer_pattern="LG", sliding_window=5, query_scale=24.0,
                        attn_logit_softcap=2.0, final_logit_softcap=8.0, norm_eps=1e-6),
    "mixtral": ModelSpec(family="mixtral", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96,
                         vocab_size=VOCAB, tie_embeddings=False, rope_theta=5e4,
                         moe=MoESpec(num_experts=4, top_k=2, capacity_factor=0.0)),
    "qwen3_moe": ModelSpec(family="qwen3_moe", num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                           vocab_size=VOCAB, tie_embeddings=False, rope_theta=5e4, head_dim=32,
                           moe=MoESpec(num_experts=4, top_k=2, capacity_factor=0.0, d_ff=48, every_n_layers=2,
                                       renormalize=False)),
    "deepseek_v3": ModelSpec(family="deepseek_v3", num_layers=3, d_model=64, num_heads=4, num_kv_heads=4, d_ff=96,
                             vocab_size=VOCAB, tie_embeddings=False, norm_eps=1e-6,
                             mla=LatentSpec(kv_lora_rank=16, q_lora_rank=0, rope_head_dim=8, nope_head_dim=12,
                                            v_head_dim=10),
                             moe=MoESpec(num_experts=8, top_k=2, capacity_factor=0.0, d_ff=32, first_dense=1,
                                         num_shared=2, score="sigmoid", expert_groups=4, top_groups=2,
                                         routed_scale=2.5, selection_bias=True)),
    "gemma3": ModelSpec(family="gemma3", num_layers=3, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                        vocab_size=VOCAB, rope_theta=5e4, rope_scaling=dict(type="linear", factor=2.0),
                        layer_pattern="LG", sliding_window=4, local_rope_theta=1e4, norm_eps=1e-6),
}


def _perturbed_hf(name: str):
    torch.manual_seed(0)
    model = HF_MODELS[name]()
    with torch.no_grad():
        for p in model.parameters():  # tied weights appear once
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _perturbed_ours(spec: ModelSpec) -> dict:
    params = LanguageModel(spec).init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), jnp.float32), params)


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _our_logits(spec: ModelSpec, params: dict) -> np.ndarray:
    return np.asarray(LanguageModel(spec).apply(params, jnp.asarray(TOKENS, jnp.int32)))


def _assert_logits_match(ours, theirs):
    assert np.abs(theirs).max() > 1.0  # logits large enough for an absolute tolerance to mean something
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", HF_MODELS)
def test_import_matches_transformers(name, tmp_path):
    hf = _perturbed_hf(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec(**model_config_from_hf(tmp_path))
    params = load_hf_params(tmp_path, spec)
    expected = LanguageModel(spec).shapes
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    jax.tree.map(lambda p, e: (p.shape, p.dtype) == (e.shape, jnp.float32) or pytest.fail(f"{p.shape} {e}"),
                 params, expected)
    _assert_logits_match(_our_logits(spec, params), _hf_logits(hf))


def _hf_greedy(model, prompt: list[int], count: int) -> list[int]:
    """transformers' full forward over the whole sequence for each new token, its argmax taken.
    (Its `generate` with a KV cache departs from its own forward on the YaRN model, position 60:
    measured 74 where the forward's logits give 2 by 0.008.)"""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# One of each family: the imported model generates as transformers' own.
FAMILY_MODELS = ["llama3_rope", "mistral_window", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe",
                 "deepseek_v3"]


@pytest.mark.parametrize("name", [*FAMILY_MODELS, "yarn_rope"])
def test_greedy_continuation_equals_transformers(name, tmp_path):
    """A 48-token prompt and 32 tokens greedily decoded with the KV cache: for scaled RoPE past the
    64-position pretrained context (each new position rotated by the scaled frequencies as
    transformers does), for the windowed models with each local layer's cache a ring of its
    window (Gemma 3's rotated by its own RoPE)."""
    from jaxscale.sampling import generate

    hf = _perturbed_hf(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec(**model_config_from_hf(tmp_path))
    prompt = TOKENS[0].tolist() * 3  # 48 tokens: generation runs to position 80
    assert generate(LanguageModel(spec), load_hf_params(tmp_path, spec), prompt, 32) == _hf_greedy(hf, prompt, 32)


def _deepseek_prediction_module(hf):
    """DeepSeek-V3's multi-token prediction module as its checkpoints store it (model.layers.N.*
    past num_hidden_layers): input norms of the next token's embedding and of the hidden state,
    their projection, an MoE decoder layer (transformers' own) and shared_head's norm; initialised
    as the model `hf` initialises its modules, then perturbed as _perturbed_hf perturbs a model."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    torch.manual_seed(1)
    config = hf.config
    width = config.hidden_size

    def norm():
        return ds.DeepseekV3RMSNorm(width, config.rms_norm_eps)

    module = torch.nn.ModuleDict({
        "enorm": norm(), "hnorm": norm(), "eh_proj": torch.nn.Linear(2 * width, width, bias=False),
        "block": ds.DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers),
        "shared_head": torch.nn.ModuleDict({"norm": norm()})})
    module.apply(hf._init_weights)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
        module["block"].mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return module.eval()


def _as_stored(state: dict) -> dict:
    """A module's state with transformers 5's fused experts (gate_up_proj [E, 2I, D], down_proj
    [E, D, I]) one tensor an expert, as DeepSeek's checkpoints store them."""
    out = {name: value.contiguous() for name, value in state.items() if ".experts." not in name}
    gate_up, down = state["block.mlp.experts.gate_up_proj"], state["block.mlp.experts.down_proj"]
    width = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out.update({f"block.mlp.experts.{e}.gate_proj.weight": gate_up[e, :width].contiguous(),
                    f"block.mlp.experts.{e}.up_proj.weight": gate_up[e, width:].contiguous(),
                    f"block.mlp.experts.{e}.down_proj.weight": down[e].contiguous()})
    return out


def _deepseek_prediction_loss(hf, module, tokens) -> float:
    """The module's mean cross entropy by DeepSeek-V3's definition, run by transformers' parts:
    at position i, [enorm(embedding of t(i+1)); hnorm(h(i))] projected, the MoE layer (causal
    mask and rotary positions as the model's), shared_head's norm and the model's head predict
    t(i+2); h is the model's last layer's output before its final norm."""
    from transformers.masking_utils import create_causal_mask

    seen = {}
    hook = hf.model.norm.register_forward_hook(lambda _, args, out: seen.setdefault("h", args[0]))
    inputs = torch.tensor(tokens[:, :-1])
    with torch.no_grad():
        hf(inputs)
        hook.remove()
        e, h = hf.model.embed_tokens(inputs[:, 1:]), seen["h"][:, :-1]
        x = module["eh_proj"](torch.cat([module["enorm"](e), module["hnorm"](h)], -1))
        places = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(config=hf.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=places)
        x = module["block"](x, attention_mask=mask, position_ids=places,
                            position_embeddings=hf.model.rotary_emb(x, places))
        logits = hf.lm_head(module["shared_head"]["norm"](x))
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(tokens[:, 2:]).flatten()))


def test_deepseek_prediction_modules_import_as_deepseek_defines_them_and_export_back(tmp_path):
    """A DeepSeek-V3 checkpoint with one prediction module (model.layers.3.*, as DeepSeek-V3's
    layer 61, with its copies of the embedding and head) imports with model.mtp_depth=1: our
    mtp_loss is the module's loss run by transformers' parts (fp32, 1e-5); export writes the
    module back bit for bit (copies included: vLLM and SGLang read them) with
    num_nextn_predict_layers, transformers still loads the model, and import reads it back."""
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    hf, source, out = _perturbed_hf("deepseek_v3"), tmp_path / "hf", tmp_path / "out"
    hf.save_pretrained(source, safe_serialization=True)
    module = _deepseek_prediction_module(hf)
    layer = f"model.layers.{hf.config.num_hidden_layers}."
    stored = {layer + name.removeprefix("block."): value for name, value in _as_stored(module.state_dict()).items()}
    stored = {**stored, layer + "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
              layer + "shared_head.head.weight": hf.lm_head.weight.detach().clone()}
    save_file({**load_torch(source / "model.safetensors"), **stored}, source / "model.safetensors", {"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))

    spec = ModelSpec(**{**model_config_from_hf(source), "mtp_depth": 1})
    params = load_hf_params(source, spec)
    tokens = np.concatenate([TOKENS, TOKENS[:, :1]], axis=1)  # 17: 16 inputs, 16 targets
    stats = jax.jit(LanguageModel(spec).loss)(params, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))[1]
    assert float(stats["mtp_loss"]) == pytest.approx(_deepseek_prediction_loss(hf, module, tokens), rel=1e-5)

    save_hf(params, spec, out)
    written, given = load_file(out / "model.safetensors"), {name: v.numpy() for name, v in stored.items()}
    assert {name for name in written if name.startswith(layer)} == set(given)
    for name, value in given.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _assert_logits_match(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval()), _hf_logits(hf))
    jax.tree.map(np.testing.assert_array_equal, load_hf_params(out, spec), params)
    with pytest.raises(ConfigError, match=r"^model\.mtp_depth=2: .* stores 1 multi-token prediction module"):
        load_hf_params(source, dataclasses.replace(spec, mtp_depth=2))


def test_latent_attention_caches_the_latent_and_the_rotary_key_only():
    """Decoding DeepSeek-V3's shape caches kv_lora_rank + qk_rope_head_dim values per token and
    layer (16 + 8 here), not 2 x heads x head width (2 x 4 x 20 keys and values)."""
    spec = SPECS["deepseek_v3"]
    cache = LanguageModel(spec).init_cache(batch=2, max_len=40)
    assert jax.tree.map(jnp.shape, cache) == {"global": {"latent": (3, 2, 40, 16 + 8)}}


def test_latent_attention_trains_under_context_parallelism_as_on_one_device():
    """DeepSeek-V3's shape (a query latent too) with its tokens over sequence (the ring attention
    on the expanded keys and values, narrower value heads) beside expert parallelism: the first
    step's loss and gradient norm equal one device's. (Its heads over tensor and its latents over
    fsdp: tests/test_prediction.py.)"""
    spec = dataclasses.replace(SPECS["deepseek_v3"], mla=dataclasses.replace(SPECS["deepseek_v3"].mla, q_lora_rank=8))
    tokens = np.random.default_rng(3).integers(0, VOCAB, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    metrics = []
    for layout in (dict(devices=1), dict(data=2, sequence=2, expert=2)):
        run = build_for(spec, rows=8, seq_len=16, **layout)
        state = run.init_state(jax.device_put(_perturbed_ours(spec), run.shardings.params))
        metrics.append(jax.device_get(run.train_step(state, jax.device_put(batch, run.batch_sharding))[1]))
    one, split = metrics
    np.testing.assert_allclose(split["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(split["grad_norm"], one["grad_norm"], rtol=1e-5)


def test_import_reads_rope_theta_and_tying(tmp_path):
    _perturbed_hf("llama_tied").save_pretrained(tmp_path, safe_serialization=True)
    fields = model_config_from_hf(tmp_path)
    assert fields["rope_theta"] == 50000.0 and fields["tie_embeddings"] and fields["num_kv_heads"] == 2
    assert RopeScaling(**fields["rope_scaling"]) == RopeScaling()  # plain RoPE
    assert "head" not in load_hf_params(tmp_path, ModelSpec(**fields))


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_import_reads_rope_scaling_in_either_spelling(spelling, tmp_path):
    """transformers 4.x writes rope_scaling beside rope_theta, 5.x rope_parameters holding both."""
    rope = {"rope_theta": 5e5, **LLAMA3_ROPE} if spelling == "rope_parameters" else LLAMA3_ROPE
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIGS["llama"], spelling: rope, "rope_theta": 5e5}))
    fields = model_config_from_hf(tmp_path)
    assert fields["rope_theta"] == 5e5 and fields["rope_scaling"] == dataclasses.asdict(RopeScaling(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64))


def test_import_base_model_names_and_bf16(tmp_path):
    """GPT2Model saves names without `transformer.` (as the original GPT-2 upload); bf16 becomes float32."""
    hf = _perturbed_hf("gpt2").to(torch.bfloat16)
    hf.transformer.save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec(**model_config_from_hf(tmp_path))
    params = load_hf_params(tmp_path, spec)
    assert params["embed"].dtype == jnp.float32
    _assert_logits_match(_our_logits(spec, params), _hf_logits(hf.float()))


@pytest.mark.parametrize("name, shard_bytes", [("llama_gqa_untied", None), ("gpt2_tied", None),
                                               ("llama_gqa_untied", 40_000), ("llama3_rope", None),
                                               ("yarn_rope", None), ("mistral", None), ("qwen2", None),
                                               ("qwen3", None), ("gemma2", None), ("gemma3", None),
                                               ("mixtral", None), ("qwen3_moe", None), ("deepseek_v3", None)])
def test_export_matches_transformers(name, shard_bytes, tmp_path):
    spec, kwargs = SPECS[name], {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    params = _perturbed_ours(spec)
    files = save_hf(params, spec, tmp_path, **kwargs)
    assert (len(files) > 2) == (shard_bytes is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (len(files) > 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__.lower().startswith(spec.family.replace("_", ""))  # its family's: Qwen3MoeForCausalLM, ...
    assert model_config_from_hf(tmp_path)["layer_pattern"] == spec.layer_pattern
    _assert_logits_match(_hf_logits(hf), _our_logits(spec, params))
    again = load_hf_params(tmp_path, spec)  # and back, bit for bit
    jax.tree.map(np.testing.assert_array_equal, again, params)


# Where an imported model trains beside one device: the dense ones on data x fsdp x tensor, a
# mixture of experts with its experts split over expert=4 (the batch over expert x data). The other
# families' paths there are trained elsewhere: Llama's on that layout in tests/test_step.py,
# Mistral's window as Gemma's here, Mixtral's experts as Qwen3-MoE's, DeepSeek-V3 on expert=4 x
# data=2 in tests/test_prediction.py (their logits against transformers' in the import test above).
TRAIN_LAYOUTS = {**dict.fromkeys(["qwen2", "qwen3", "gemma2", "gemma3"], dict(data=2, fsdp=2, tensor=2)),
                 "qwen3_moe": dict(expert=4, data=2)}


@pytest.mark.parametrize("name", TRAIN_LAYOUTS)
def test_an_imported_model_trains_on_data_fsdp_tensor_as_on_one_device_and_as_transformers(name, tmp_path):
    """Loaded straight onto data=2 x fsdp=2 x tensor=2 (Qwen2's biases and Qwen3's q, k norms
    whole, Qwen3's wide heads split over tensor; the windows and Gemma 2's soft-caps in the
    blockwise kernel's backward and the vocabulary-parallel loss), or Qwen3-MoE's experts onto
    expert=4 x data=2, the first step's loss equals one device's and transformers' own loss on the
    same tokens, and the gradient norms agree."""
    hf = _perturbed_hf(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec(**model_config_from_hf(tmp_path))
    tokens = np.random.default_rng(2).integers(0, VOCAB, (8, 17)).astype(np.int32)
    with torch.no_grad():
        logits = hf(torch.tensor(tokens[:, :-1])).logits
        theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(tokens[:, 1:]).long()
                                                         .reshape(-1)))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    metrics = []
    for sizes in (dict(devices=1), TRAIN_LAYOUTS[name]):
        run = build_for(spec, rows=8, seq_len=16, **sizes)
        state = run.init_state(load_hf_params(tmp_path, spec, run.shardings.params))
        metrics.append(jax.device_get(run.train_step(state, jax.device_put(batch, run.batch_sharding))[1]))
    one, split = metrics
    np.testing.assert_allclose(split["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(split["grad_norm"], one["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(one["loss"], theirs, rtol=1e-5)  # the cross-entropy (a mixture's balancing loss aside)


def test_sharded_load_and_save(tmp_path):
    """Load straight into a pipeline x fsdp x tensor layout, save from it: same values, requested shardings."""
    spec = SPECS["llama_gqa_untied"]
    params = _perturbed_ours(spec)
    save_hf(params, spec, tmp_path / "a")
    layout = make_layout(pipeline=2, fsdp=2, tensor=2)
    shardings = shd.named(layout.mesh, param_specs(LanguageModel(spec), layout, over_data=False))
    loaded = load_hf_params(tmp_path / "a", spec, shardings)
    jax.tree.map(lambda x, s: x.sharding == s or pytest.fail(f"{x.sharding} != {s}"), loaded, shardings)
    assert loaded["layers"]["attn"]["wq"].sharding.spec == P("pipeline", "fsdp", "tensor")
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    save_hf(loaded, spec, tmp_path / "b")
    jax.tree.map(np.testing.assert_array_equal, load_hf_params(tmp_path / "b", spec), params)


def test_loading_holds_one_layer_on_the_host(tmp_path):
    """Peak host allocation while loading stays far below the largest stacked parameter.

    An implementation that stacks layers on the host needs at least that parameter's size; the
    lower bound checks that tracemalloc sees the tensors being read at all. Reads that ran ahead of
    the device's transfers held 1.8 to 4.4 MB here, more the busier the machine (measured); waiting
    for each layer's transfer holds 1.8 MB.
    """
    spec = ModelSpec(family="llama", num_layers=16, d_model=128, num_heads=4, num_kv_heads=4, d_ff=1024, vocab_size=64)
    save_hf(LanguageModel(spec).init(jax.random.PRNGKey(0)), spec, tmp_path)
    load_hf_params(tmp_path, spec)  # compile outside the measurement
    largest = 4 * spec.num_layers * spec.d_model * spec.d_ff  # w_gate, w_up, w_down: 8 MiB each
    tracemalloc.start()
    try:
        params = load_hf_params(tmp_path, spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert params["layers"]["mlp"]["w_gate"].nbytes == largest
    assert largest // spec.num_layers <= peak < largest // 2, (peak, largest)


BASE_CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  intermediate_size=128, vocab_size=VOCAB),
}


@pytest.mark.parametrize("family, changes, field", [
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type"),
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type"),
    ("llama", dict(rope_scaling={**YARN_ROPE, "mscale": 0.707}), "rope_parameters.mscale"),
    ("llama", dict(partial_rotary_factor=0.5, rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                              "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(model_type="phi3"), "model_type"),
    ("llama", dict(model_type="qwen3", attention_bias=True), "attention_bias"),
    ("llama", dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
    ("llama", dict(model_type="qwen2", layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    ("llama", dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation"),
    ("llama", dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("llama", dict(model_type="gemma2", layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    ("gpt2", dict(activation_function="gelu"), "activation_function"),
])
def test_bad_config_names_the_field(family, changes, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIGS[family], **changes}))
    with pytest.raises(ConfigError) as error:
        model_config_from_hf(tmp_path)
    assert error.value.field == field and str(error.value).startswith(f"{field}=")


def test_mismatches_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    spec = SPECS["gpt2_tied"]
    with pytest.raises(ConfigError, match="model.num_kv_heads=2: Hugging Face GPT-2 has no grouped-query"):
        save_hf({}, ModelSpec(**{**spec.__dict__, "num_kv_heads": 2}), tmp_path)
    save_hf(_perturbed_ours(spec), spec, tmp_path)
    with pytest.raises(ConfigError, match=r"^model\.num_layers=3: .* has 2; set model\.num_layers=2"):
        load_hf_params(tmp_path, ModelSpec(**{**spec.__dict__, "num_layers": 3}))
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    save_file({**tensors, "transformer.h.0.attn.q_norm.weight": np.ones(16, np.float32)}, file, {"format": "pt"})
    with pytest.raises(ConfigError, match="tensor='transformer.h.0.attn.q_norm.weight': jaxscale's gpt2 has no"):
        load_hf_params(tmp_path, spec)
    save_file({k: v for k, v in tensors.items() if k != "transformer.wpe.weight"}, file, {"format": "pt"})
    with pytest.raises(ConfigError, match="tensor='transformer.wpe.weight': is missing"):
        load_hf_params(tmp_path, spec)
