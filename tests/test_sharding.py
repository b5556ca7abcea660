"""Logical axes -> PartitionSpecs, ZeRO stages, and the sharded train state."""

from types import SimpleNamespace

import jax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import build_for, make_layout
from jaxscale.config import defaults
from jaxscale.models import LanguageModel, ModelSpec
from jaxscale.sharding import add_axis, rules_from_config
from jaxscale.state import param_specs


def test_rules_drop_size_one_axes_and_reuse():
    layout = make_layout(data=2, fsdp=2, tensor=2)
    assert layout.spec(("batch", "length")) == P(("data", "fsdp"))
    assert layout.spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert layout.spec(("heads", "mlp")) == P("tensor")  # tensor used once per array
    assert layout.spec(("layers", "embed", "heads", "head_dim")) == P(None, "fsdp", "tensor")
    assert layout.spec(("batch", "length", "act_embed")) == P(("data", "fsdp"))
    assert layout.inside("data").spec(("batch", "act_length", "act_mlp")) == P("fsdp", None, "tensor")
    assert make_layout(data=8).spec(("embed", "mlp")) == P()


def test_unmatched_axis_names_the_parameter():
    with pytest.raises(ValueError, match=r"\['layers'\]\['w'\].*'widgets'"):
        model = SimpleNamespace(axes={"layers": {"w": ("widgets", "embed")}},
                                shapes={"layers": {"w": jax.ShapeDtypeStruct((4, 8), "float32")}})
        param_specs(model, make_layout(data=8), over_data=False)


def test_add_axis_picks_a_divisible_dimension():
    mesh = make_layout(data=4, fsdp=2).mesh
    assert add_axis(P("fsdp"), (64, 6), "data", mesh) == P(("data", "fsdp"))
    assert add_axis(P(None, None), (6, 64), "data", mesh) == P(None, "data")
    assert add_axis(P(), (3,), "data", mesh) == P()  # too small: stays replicated


def test_config_rules_sequence_parallel_and_kv_replication():
    config = defaults()
    config.sharding.rules.embed = "fsdp,data"
    config.sharding.sequence_parallel = True
    config.model.update(num_heads=8, num_kv_heads=2)
    sizes = {"data": 1, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 4}
    rules, notes = rules_from_config(config, sizes)
    assert rules["embed"] == ("fsdp", "data") and rules["length"] == ("sequence", "tensor")
    assert "tensor" not in rules["kv_heads"] and "replicated" in notes[0]
    # On by default; where seq_len does not divide over tensor it stays off, and a note says so.
    config = defaults()
    config.train.seq_len = 66
    rules, notes = rules_from_config(config, sizes)
    assert rules["length"] == ("sequence",) and "train.seq_len=66 does not divide" in notes[0]
    assert rules_from_config(config, {**sizes, "tensor": 1})[0]["length"] == ("sequence",)  # no tensor axis: off


# kv heads divisible by tensor=4: these layouts use the default rules, which (unlike a config's,
# see rules_from_config) do not replicate kv heads that the tensor axis cannot split.
MODEL = ModelSpec(num_layers=2, d_model=64, num_heads=4, num_kv_heads=4, d_ff=128, vocab_size=256)
LAYOUTS = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "zero1_data8": dict(data=8, zero_stage=1),
    "zero3_data8": dict(data=8, zero_stage=3),
    "pipeline2_fsdp4": dict(pipeline=2, fsdp=4, microbatches=2),
}
# Expected specs of a few parameters (and their Adam moments) under each layout.
EXPECTED = {
    "data8": {"wq": P(), "w_down": P(), "embed": P(), "mu_wq": P()},
    "fsdp8": {"wq": P(None, "fsdp"), "w_down": P(None, None, "fsdp"), "embed": P(None, "fsdp"),
              "mu_wq": P(None, "fsdp")},
    "data2_tensor4": {"wq": P(None, None, "tensor"), "w_down": P(None, "tensor"), "embed": P("tensor"),
                      "mu_wq": P(None, None, "tensor")},
    "zero1_data8": {"wq": P(), "w_down": P(), "embed": P(), "mu_wq": P(None, "data")},
    # ZeRO-3 splits over data where FSDP would (the d_model dimension): one gather makes a weight whole
    "zero3_data8": {"wq": P(None, "data"), "w_down": P(None, None, "data"), "embed": P(None, "data"),
                    "mu_wq": P(None, "data")},
    # the layer dimension is split over pipeline: each device's contiguous block of layers is its stage
    "pipeline2_fsdp4": {"wq": P("pipeline", "fsdp"), "w_down": P("pipeline", None, "fsdp"), "embed": P(None, "fsdp"),
                        "mu_wq": P("pipeline", "fsdp")},
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_state_partition_specs(name):
    run = build_for(MODEL, **LAYOUTS[name])
    shardings = run.shardings
    params, adam = shardings.params, shardings.opt_state[1][0]
    got = {"wq": params["layers"]["attn"]["wq"].spec, "w_down": params["layers"]["mlp"]["w_down"].spec,
           "embed": params["embed"].spec, "mu_wq": adam.mu["layers"]["attn"]["wq"].spec}
    assert got == EXPECTED[name]
    for moment in (adam.mu, adam.nu):
        jax.tree.map(lambda m, p, shape: assert_zero_split(m, p, shape.shape, run.layout.zero_stage),
                     moment, params, run.model.shapes)
    assert shardings.step.spec == P() and shardings.rng.spec == P()


def assert_zero_split(moment, param, shape, zero_stage):
    """A moment is placed like its parameter, and from ZeRO stage 1 split over `data` too (unless
    stage 3 split the parameter already): one dimension of the parameter's shard divided by the
    data axis size, where one divides; checked on the shard shapes, not on how the specs are built."""
    mine, theirs = moment.shard_shape(shape), param.shard_shape(shape)
    data = moment.mesh.shape["data"]
    if zero_stage in (1, 2) and data > 1 and any(d % data == 0 for d in theirs):
        split = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        assert len(split) == 1 and mine[split[0]] * data == theirs[split[0]], (mine, theirs)
        assert _without(moment.spec, "data") == _without(param.spec, "data"), (moment.spec, param.spec)
    else:
        assert moment.spec == param.spec, (moment.spec, param.spec)


def _without(spec, axis):
    """The spec's mesh axes per dimension, `axis` left out and trailing replicated dimensions dropped."""
    dims = [tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a != axis) for e in spec]
    while dims and not dims[-1]:
        dims.pop()
    return dims


def test_state_is_created_sharded():
    state = build_for(MODEL, fsdp=8).init_state()
    wq = state.params["layers"]["attn"]["wq"]
    assert wq.sharding.spec == P(None, "fsdp") and wq.addressable_shards[0].data.shape == (2, 8, 4, 16)


def test_every_parameter_spec_fsdp2_tensor4_untied():
    spec = ModelSpec(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, d_ff=128, vocab_size=256,
                     tie_embeddings=False)
    layout = make_layout(fsdp=2, tensor=4)
    got = jax.tree_util.tree_flatten_with_path(
        param_specs(LanguageModel(spec), layout, over_data=False), is_leaf=lambda x: isinstance(x, P))[0]
    got = {jax.tree_util.keystr(path): s for path, s in got}
    assert got == {
        "['embed']": P("tensor", "fsdp"),                     # vocab x embed
        "['head']": P("fsdp", "tensor"),                      # embed x vocab (column parallel logits)
        "['final_norm']['scale']": P(),                       # vectors along d_model stay whole
        "['layers']['attn_norm']['scale']": P(),
        "['layers']['mlp_norm']['scale']": P(),
        "['layers']['attn']['wq']": P(None, "fsdp", "tensor"),  # column parallel over heads
        "['layers']['attn']['wk']": P(None, "fsdp", "tensor"),
        "['layers']['attn']['wv']": P(None, "fsdp", "tensor"),
        "['layers']['attn']['wo']": P(None, "tensor", None, "fsdp"),  # row parallel
        "['layers']['mlp']['w_gate']": P(None, "fsdp", "tensor"),
        "['layers']['mlp']['w_up']": P(None, "fsdp", "tensor"),
        "['layers']['mlp']['w_down']": P(None, "tensor", "fsdp"),
    }
