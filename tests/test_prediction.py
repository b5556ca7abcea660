"""Multi-token prediction (models/prediction.py): the loss its definition gives, on any layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build_for
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.models.attention import Placement
from jaxscale.models.latent import LatentSpec
from jaxscale.models.moe import MoESpec

VOCAB = 100
# DeepSeek-V3's shape, tiny: latent attention, a dense first layer, grouped sigmoid routing, two
# prediction modules (each an MoE layer of the model's kind).
SPEC = ModelSpec(family="deepseek_v3", num_layers=3, d_model=64, num_heads=4, num_kv_heads=4, d_ff=96,
                 vocab_size=VOCAB, tie_embeddings=False, mtp_depth=2, mtp_loss_weight=0.3,
                 mla=LatentSpec(kv_lora_rank=16, q_lora_rank=8, rope_head_dim=8, nope_head_dim=12, v_head_dim=10),
                 moe=MoESpec(num_experts=8, top_k=2, capacity_factor=0.0, d_ff=32, first_dense=1, num_shared=1,
                             score="sigmoid", expert_groups=4, top_groups=2, routed_scale=2.5, selection_bias=True,
                             aux_loss_weight=0.0, z_loss_weight=0.0))
TOKENS = np.random.default_rng(3).integers(0, VOCAB, (8, 17)).astype(np.int32)


def _reference(params):
    """Module k by its definition, with whole logits: its input at position i is the previous
    module's hidden state (the model's last layer's for k = 1) and the embedding of t(i+k); its
    target t(i+k+1); only the positions that have one count."""
    model = nnx.merge(LanguageModel(SPEC).graphdef, params)
    inputs, targets = jnp.asarray(TOKENS[:, :-1]), jnp.asarray(TOKENS[:, 1:])
    length = inputs.shape[1]
    places = Placement(jnp.broadcast_to(jnp.arange(length), inputs.shape))
    h = model.hidden(inputs, places)[0]
    graphdef, state = nnx.split(model.mtp)
    losses = []
    for k in range(1, SPEC.mtp_depth + 1):
        module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], nnx.to_pure_dict(state)))
        ahead = jnp.pad(targets[:, k - 1:], ((0, 0), (0, k - 1)))  # t(i+k); the last k-1 padded
        h = module(jnp.concatenate([model.embed_tokens(ahead, places), h], -1), places)[0]
        logits = jnp.einsum("BLD,DV->BLV", module.final_norm(h), params["head"])[:, :length - k]
        picked = jnp.take_along_axis(logits, targets[:, k:, None], -1)[..., 0]
        losses.append(jnp.mean(jax.nn.logsumexp(logits, -1) - picked))
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def one_device():
    """The first step's metrics on one device, and the parameters it started from."""
    params = jax.device_get(LanguageModel(SPEC).init(jax.random.PRNGKey(0)))  # on the host: each run its copy
    return _first_step(dict(devices=1), params), params


def _first_step(sizes, params):
    run = build_for(SPEC, rows=8, seq_len=16, **sizes)
    state = run.init_state(jax.device_put(params, run.shardings.params))
    batch = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}
    return jax.device_get(run.train_step(state, jax.device_put(batch, run.batch_sharding))[1])


def test_the_prediction_loss_is_its_definition_and_joins_the_objective(one_device):
    metrics, params = one_device
    # Jitted: run op by op, the reference's and the loss's hundreds of small ops compile one by one.
    assert metrics["mtp_loss"] == pytest.approx(float(jax.jit(_reference)(params)), rel=1e-5)
    objective, stats = jax.jit(LanguageModel(SPEC).loss)(params, jnp.asarray(TOKENS[:, :-1]),
                                                         jnp.asarray(TOKENS[:, 1:]))
    assert float(objective) == pytest.approx(float(stats["loss"] + 0.3 * stats["mtp_loss"]), rel=1e-6)


@pytest.mark.parametrize("sizes", [dict(expert=4, data=2), dict(data=2, fsdp=2, tensor=2)])
def test_prediction_trains_on_expert_and_fsdp_tensor_layouts_as_on_one_device(one_device, sizes):
    """Also latent attention's heads over tensor and its latents (queries' and keys') over fsdp."""
    one, params = one_device
    split = _first_step(sizes, params)
    for key in ("loss", "mtp_loss", "grad_norm"):
        np.testing.assert_allclose(split[key], one[key], rtol=1e-5, err_msg=key)
