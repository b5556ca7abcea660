"""Multi-token prediction (DeepSeek-V3): D modules after the model, module k predicting the token
k + 1 places past the next one.

Module k takes each position i's hidden state from the one before it (the model's last layer,
before its final norm, for k = 1) and the embedding of token t(i+k), normalises both, projects
their concatenation [norm(embedding); norm(hidden)] from 2 x d_model back to d_model, runs one
transformer layer of the model's kind (an MoE layer in an MoE model), and through its own final
norm and the model's head predicts t(i+k+1): a cross entropy over the positions that have such a
token (the last k of a row have none). The embedding and the head are the model's. The modules'
losses are averaged into `mtp_loss`, which the objective adds times model.mtp_loss_weight.

The module's layer routes as the model's MoE layers do; its router statistics are not reported
and its selection bias is not balanced (it stays as initialised or imported).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.layers import RESIDUAL, norm, normal
from jaxscale.models.vocab import IGNORE
from jaxscale.sharding import constrain

LOSS = "mtp_loss"


class Prediction(nnx.Module):
    """One multi-token prediction module: its two input norms, projection, layer (made by
    `make_block(rngs)`) and final norm."""

    def __init__(self, spec, rngs: nnx.Rngs, make_block):
        D = spec.d_model
        self.e_norm, self.h_norm = norm(spec), norm(spec)
        self.proj = normal(rngs, (2 * D, D), ("embed", "embed"), spec.init_std)
        self.block = make_block(rngs)
        self.final_norm = norm(spec)
        self.layout = spec.strategy.layout

    def __call__(self, eh_BLX, places):
        """(the module's hidden states [B, L, D], before its final norm; {}) of [embedding; hidden]
        concatenated along the last axis (one array, so that a layer's map takes it as it takes
        the residual stream)."""
        e_BLD, h_BLD = jnp.split(eh_BLX, 2, axis=-1)
        x_BLX = jnp.concatenate([self.e_norm(e_BLD), self.h_norm(h_BLD)], axis=-1)
        x_BLD = jnp.einsum("BLX,XD->BLD", x_BLX, self.proj[...].astype(x_BLX.dtype))
        out = self.block(constrain(x_BLD, self.layout, RESIDUAL), places)
        return out[0], {}


def shifted(tokens_BL, k: int):
    """Each row's tokens k places on (the last k positions 0, see `valid`)."""
    if k == 0:
        return tokens_BL
    return jnp.concatenate([tokens_BL[:, k:], jnp.zeros_like(tokens_BL[:, :k])], axis=1)


def valid(tokens_BL, k: int):
    """1.0 where a row has a token k places on, 0.0 for its last k positions."""
    length = tokens_BL.shape[1]
    return jnp.broadcast_to((jnp.arange(length) < length - k).astype(jnp.float32), tokens_BL.shape)


def loss(model, x_BLD, inputs_BL, targets_BL, places):
    """The mean cross entropy of the Transformer `model`'s modules (model.mtp, stacked) after its
    last layer's output x_BLD, each module's layer placed and gathered as the model's layers are.
    Module k reads t(i+k), the inputs k places on, and predicts t(i+k+1), the targets k places
    on, where the row has it. Under a loss mask (targets vocab.IGNORE where not trained) it
    trains on the trained ones, each module's loss their mean in this batch (or microbatch);
    an untrained token is still read as an input."""
    graphdef, state = nnx.split(model.mtp)
    params, dims = nnx.to_pure_dict(state), model._stored_dims(state)  # dims: a module's, as a layer's
    norm_def = nnx.split(model.mtp.final_norm)[0]
    total, h_BLD = 0.0, x_BLD
    for k in range(1, model.spec.mtp_depth + 1):
        module = jax.tree.map(lambda a, k=k: a[k - 1], params)
        e_BLD = model.embed_tokens(shifted(inputs_BL, k), places).astype(h_BLD.dtype)
        h_BLD = model._run_layer(lambda p, x, places: nnx.merge(graphdef, p)(x, places), module, dims,
                                 jnp.concatenate([e_BLD, h_BLD], axis=-1),
                                 places.at_layer(model.spec.num_layers + k - 1))[0]  # numbered after the model's
        final_norm = (norm_def, module["final_norm"], dims and dims["final_norm"])
        target_BL = shifted(targets_BL, k)
        keep_BL = valid(targets_BL, k) * (target_BL != IGNORE)
        total = total + model.head_loss(h_BLD, jnp.maximum(target_BL, 0), final_norm, keep_BL)[0]
    return total / model.spec.mtp_depth
