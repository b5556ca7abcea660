"""Logical axis names -> mesh axes -> PartitionSpecs: the one table that places every array.

Parameters and activations use different names where they must be placed differently:
`embed` (a weight's model dimension) is split over `fsdp`, while `act_embed` (the model
dimension of activations) is not; `length` is the residual stream's sequence dimension, split
over `tensor` too in sequence-parallel mode, and `act_length` the one inside tensor-parallel
regions (attention, MLP), which never is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.errors import field_value, require, require_choice
from jaxscale.mesh import make_mesh
from jaxscale.names import AXES, COLLECTIVE_MATMULS, DEFAULT_RULES, OVERLAP_SETTINGS, split_ways

Entries = tuple[tuple[str, ...], ...]  # a PartitionSpec as one tuple of mesh axes per dimension


class Stored(NamedTuple):
    """Where a parameter is stored, and of those splits the ones a layer keeps where it uses the
    parameter (the experts' over `expert`: each device runs its own experts); the rest it gathers."""

    split: Entries
    kept: Entries


def entries(spec: P, ndim: int) -> Entries:
    """A PartitionSpec as one tuple of mesh axes per dimension."""
    padded = list(spec) + [None] * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in padded)


def to_spec(dims) -> P:
    """The inverse of `entries` (trailing unsplit dimensions dropped)."""
    out = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in dims]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def keep(dims: Entries, axes) -> Entries:
    """`dims` with only the mesh axes in `axes`."""
    return tuple(tuple(a for a in e if a in axes) for e in dims)


def manual_here() -> tuple[str, ...]:
    """The mesh axes an enclosing shard_map makes manual at this point of tracing."""
    context = jax.sharding.get_abstract_mesh()
    return () if context.empty else tuple(context.manual_axes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh, its rule table and the ZeRO stage: the one authority on where arrays live. Every
    placement question is asked here: the mesh axes of a logical name, a parameter's stored
    split, the batch's axes, the axes manual at this point, the mesh a shard_map names."""

    mesh: Mesh
    rule_items: tuple[tuple[str, tuple[str, ...]], ...] = tuple(DEFAULT_RULES.items())
    zero_stage: int = 0
    manual_axes: tuple[str, ...] = ()  # inside shard_map over these axes: specs must not name them

    @classmethod
    def of(cls, mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES, zero_stage: int = 0) -> Layout:
        return cls(mesh, tuple((k, tuple(v)) for k, v in rules.items()), zero_stage)

    def inside(self, *manual: str) -> Layout:
        """This layout as seen inside shard_map over `manual` axes."""
        return dataclasses.replace(self, manual_axes=self.manual_axes + manual)

    def here(self) -> Layout:
        """This layout as seen at this point of tracing: without the axes an enclosing shard_map
        made manual."""
        return self.inside(*(a for a in manual_here() if a not in self.manual_axes))

    @property
    def rules(self) -> Mapping[str, tuple[str, ...]]:
        return dict(self.rule_items)

    @property
    def compiler(self) -> str:
        """The platform the program is compiled for ('cpu', 'gpu', 'tpu'): its devices', also
        when they are a topology compiled for on another host."""
        return self.mesh.devices.flat[0].platform

    def spec(self, names: tuple[str | None, ...], where: str = "") -> P:
        """PartitionSpec for dimensions with these logical names (None: not split); each mesh
        axis used at most once."""
        rules, used, dims = self.rules, set(), []
        for name in names:
            if name is None:  # explicitly unsplit
                dims.append(())
                continue
            if name not in rules:
                raise ValueError(f"{where or 'array'}: logical axis '{name}' matches no sharding rule; "
                                 f"add --config.sharding.rules.{name}=AXES (known: {', '.join(sorted(rules))})")
            axes = tuple(a for a in rules[name]
                         if self.mesh.shape[a] > 1 and a not in used and a not in self.manual_axes)
            used.update(axes)
            dims.append(axes)
        return to_spec(dims)

    def axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes logical axis `name` is split over at this point of tracing (the manual
        axes of an enclosing shard_map left out)."""
        return entries(self.here().spec((name,)), 1)[0]

    def batch_axes(self, *besides: str) -> tuple[str, ...]:
        """The mesh axes the batch is split over here, less `besides`: the axes a shard_map over
        rows makes manual too, so that what each row needs stays on its device and gradients of
        what it shares are summed once, at the map's edge."""
        return tuple(a for a in self.axes("batch") if a not in besides)

    def rows_over(self, *axes: str) -> P:
        """The spec of a [batch, ...] array inside a map over `axes`: its rows split over those of
        `axes` the batch is split over (replicated over the rest)."""
        return to_spec([tuple(a for a in self.axes("batch") if a in axes)])

    def free_axes(self) -> set[str]:
        """The mesh axes not manual here."""
        return set(self.mesh.axis_names) - set(manual_here())

    def mesh_here(self):
        """The mesh a shard_map should name here: inside another shard_map (gradient accumulation
        over `data`, a pipeline stage), the context's abstract mesh, whose manual axes it inherits."""
        context = jax.sharding.get_abstract_mesh()
        return context if not context.empty and context.manual_axes else self.mesh

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The batch axes that may split weights for storage: those a dense weight's rule names
        (fsdp, and by default expert), and `data` (ZeRO-3). Those a dense weight's rule does not
        name never split a weight that a layer gathers."""
        named = {a for name in DENSE_WEIGHTS for a in self.rules.get(name, ())}
        return tuple(a for a in self.rules["batch"] if a in named or a == "data")

    def param_spec(self, names: tuple[str, ...], shape: tuple[int, ...], over_data: bool = False,
                   where: str = "") -> P:
        """Where a parameter-shaped array is stored: its rules, and with `over_data` (ZeRO) split
        over `data` too. The `data` split joins the dimension FSDP splits (the one named `embed`),
        so that ZeRO-3 is FSDP over one more axis and a weight is gathered whole by one
        all-gather; where that dimension does not divide, it goes where `add_axis` puts it."""
        spec = self.spec(names, where)
        if not over_data or self.mesh.shape["data"] == 1:
            return spec
        if "embed" in names:
            dim = names.index("embed")
            dims = list(entries(spec, len(shape)))
            parts = math.prod(self.mesh.shape[a] for a in dims[dim]) * self.mesh.shape["data"]
            if "data" not in dims[dim] and shape[dim] % parts == 0:
                # data inside fsdp's blocks: a ZeRO-1/2 moment or gradient block is then a slice of
                # its parameter's block (data first, the optimizer update permuted every leaf)
                dims[dim] = dims[dim] + ("data",)
                return to_spec(dims)
        return add_axis(spec, shape, "data", self.mesh)

    def stored(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Entries:
        """Where a parameter with these logical names and (whole) shape is stored, as the state
        places it (ZeRO-3 included): one tuple of mesh axes per dimension."""
        return entries(self.param_spec(names, shape, self.zero_stage >= 3), len(shape))

    def placed(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Stored:
        """`stored`, with the splits a layer keeps: those of the dimension named `experts`."""
        split = self.stored(names, shape)
        return Stored(split, tuple(e if name == "experts" else () for name, e in zip(names, split)))

    def reduces_in_float32(self, dtype) -> bool:
        """`reduces_in_float32` for this layout's compiler."""
        return reduces_in_float32(self.compiler, dtype)

    def sharding(self, names: tuple[str, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def batch_sharding(self) -> NamedSharding:
        """Sharding of a [batch, length] token array."""
        return self.sharding(("batch", "length"))


def reduces_in_float32(compiler: str, dtype) -> bool:
    """Whether a reduction of `dtype` across devices runs in float32 instead, decided by the
    compile target: bfloat16 on XLA:CPU, whose all-reduce promotion aborts the process on one in
    a manual region ("Invalid binary instruction opcode copy")."""
    return compiler == "cpu" and jax.numpy.dtype(dtype) == jax.numpy.bfloat16


def constrain(x: jax.Array, layout: Layout | None, where) -> jax.Array:
    """x placed where `where` says: logical names (placed by `layout`'s rules) or a
    PartitionSpec of mesh axes. A no-op without a layout (one program: `Strategy()`).

    Inside shard_map the constraint is stated on the context's mesh and leaves out its manual axes.
    """
    if layout is None:
        return x
    spec = where if isinstance(where, P) else layout.here().spec(where)
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh_here(), spec))


def add_axis(spec: P, shape: tuple[int, ...], axis: str, mesh: Mesh) -> P:
    """`spec` further split over `axis` on the dimension that takes it best (ZeRO over `data`).

    Picks the dimension with the most elements per shard whose size stays divisible; a leaf too
    small to split (a scalar, a norm scale smaller than the axis) stays replicated over `axis`.
    """
    size, dims = mesh.shape[axis], list(entries(spec, len(shape)))
    if size == 1 or any(axis in e for e in dims):
        return spec
    fits = [d for d in range(len(shape)) if shape[d] % (math.prod(mesh.shape[a] for a in dims[d]) * size) == 0]
    if not fits:
        return spec
    best = max(fits, key=lambda d: shape[d] // math.prod(mesh.shape[a] for a in dims[d]))
    dims[best] = tuple(sorted(dims[best] + (axis,), key=mesh.axis_names.index))  # outer mesh axis first
    return to_spec(dims)


def named(mesh: Mesh, specs):
    """NamedShardings for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def rules_from_config(config, sizes: Mapping[str, int]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """The rule table for a run: defaults, config overrides, then layout-dependent adjustments.

    Returns (rules, notes): notes are one-line explanations of adjustments made.
    """
    rules = dict(DEFAULT_RULES)
    for name, text in config.sharding.rules.items():
        rules[name] = tuple(a.strip() for a in text.split(",") if a.strip())
    notes = []
    if config.sharding.sequence_parallel and sizes.get("tensor", 1) > 1 and "tensor" not in rules["length"]:
        length = rules["length"] + ("tensor",)
        if config.train.seq_len % split_ways(length, sizes)[0] == 0:
            rules["length"] = length
        else:
            notes.append(f"train.seq_len={config.train.seq_len} does not divide over {length}: norms and residuals "
                         "stay whole along length over tensor (sharding.sequence_parallel)")
    parts, axes = split_ways(rules["vocab"], sizes)
    if config.model.vocab_size % parts:
        rules["vocab"] = rules["act_vocab"] = ()
        notes.append(f"model.vocab_size={config.model.vocab_size} does not divide over {axes}: the embedding and "
                     "head are whole along the vocabulary there (still split along d_model by fsdp)")
    tensor, kv = sizes["tensor"], config.model.num_kv_heads
    if tensor > 1 and kv % tensor:
        rules["kv_heads"] = tuple(a for a in rules["kv_heads"] if a != "tensor")
        rules["act_kv_heads"] = tuple(a for a in rules["act_kv_heads"] if a != "tensor")
        notes.append(f"model.num_kv_heads={kv} does not divide over tensor={tensor}: "
                     "key/value projections are replicated across the tensor axis")
    return rules, notes


def batch_shards(config, sizes: Mapping[str, int]) -> tuple[int, str]:
    """(the pieces the batch is split into, its axes as text) by the run's rule for `batch`."""
    return split_ways(rules_from_config(config, sizes)[0]["batch"], sizes)


def check_rules(config, sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """The run's rule table (`rules_from_config`), after checking that it names only mesh axes;
    raises ConfigError naming the rule."""
    rules = rules_from_config(config, sizes)[0]
    for name, axes in rules.items():
        for axis in axes:
            require(axis in AXES, f"sharding.rules.{name}", ",".join(axes),
                    f"'{axis}' is not a mesh axis; use {', '.join(AXES)}")
    return rules


# Logical axes of the weights outside MoE layers' experts: layers gather what fsdp and expert split
# (the experts' own `expert` split they use as it is: Stored.kept).
DENSE_WEIGHTS = ("embed", "heads", "kv_heads", "head_dim", "latent", "mlp", "vocab", "position", "norm", "router")


# Logical axis -> the config fields holding that dimension's sizes (one of 0: no such dimension).
_DIMENSIONS = {"embed": ("model.d_model",), "heads": ("model.num_heads",), "kv_heads": ("model.num_kv_heads",),
               "mlp": ("model.d_ff",), "vocab": ("model.vocab_size",), "layers": ("model.num_layers",),
               "experts": ("model.moe.num_experts",), "latent": ("model.mla.kv_lora_rank", "model.mla.q_lora_rank")}


def check_layout(config, rules: Mapping[str, tuple[str, ...]], sizes: Mapping[str, int]) -> None:
    """A valid ZeRO stage, overlap and collective matmul setting, and every dimension the rules split divides evenly
    into its pieces (shardings must be even); raises ConfigError naming the field to change."""
    require(0 <= config.zero_stage <= 3, "zero_stage", config.zero_stage, "choose 0, 1, 2 or 3")
    require_choice("sharding.overlap", config.sharding.overlap, OVERLAP_SETTINGS)
    require_choice("sharding.collective_matmul", config.sharding.collective_matmul, COLLECTIVE_MATMULS)
    for name, fields in _DIMENSIONS.items():
        parts, axes = split_ways(rules[name], sizes)
        for field in fields:
            size = field_value(config, field)
            require(size % parts == 0, field, size, f"the '{name}' dimension is split {parts} ways ({axes}); "
                    f"use a multiple of {parts} or change the mesh")
    parts = split_ways(rules["length"], sizes)[0]
    require(config.train.seq_len % parts == 0, "train.seq_len", config.train.seq_len,
            f"activations are split {parts} ways along length; use a multiple of {parts}")


def layout_from_config(config, devices=None) -> tuple[Layout, list[str]]:
    """The run's Layout (mesh, rules, ZeRO stage) and notes on rule adjustments."""
    mesh = make_mesh(config.mesh, devices, config.mesh_dcn)
    rules, notes = rules_from_config(config, dict(mesh.shape))
    return Layout.of(mesh, rules, config.zero_stage), notes
