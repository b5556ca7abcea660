"""Logical axes -> PartitionSpecs, and the sharded train state."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale import state as state_lib
from jaxscale.mesh import make_mesh
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.optim import make_optimizer
from jaxscale.sharding import batch_sharding, logical_to_spec, tree_specs


def _mesh(**sizes):
    cfg = {"data": 1, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1, **sizes}
    return make_mesh(cfg)


def test_rules_drop_size_one_axes_and_reuse():
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    assert logical_to_spec(("batch", "length"), mesh) == P(("data", "fsdp"))
    assert logical_to_spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("heads", "mlp"), mesh) == P("tensor")  # tensor used once per array
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), mesh) == P(None, "fsdp", "tensor")
    assert logical_to_spec(("embed", "mlp"), _mesh(data=8)) == P()


def test_unmatched_axis_names_the_parameter():
    with pytest.raises(ValueError, match=r"\['layers'\]\['w'\].*'experts'"):
        tree_specs({"layers": {"w": ("experts", "embed")}}, _mesh(data=8))


def test_data_parallel_state_is_replicated_and_batch_split():
    mesh = _mesh(data=8)
    model = LanguageModel(ModelSpec(num_layers=2, d_model=32, num_heads=2, num_kv_heads=2, d_ff=64))
    tx, _ = make_optimizer(_optim(), 10)
    state, shardings = state_lib.init(model, tx, 0, mesh)
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.spec == P() and leaf.sharding.mesh.shape["data"] == 8
    assert batch_sharding(mesh).spec == P("data")
    # each Adam moment carries its parameter's sharding (optax tree_map_params)
    mu = state.opt_state[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(state.params)


def _optim():
    from jaxscale.config import defaults
    return defaults().optim
