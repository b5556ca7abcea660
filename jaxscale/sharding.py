"""Logical axis names -> mesh axes -> PartitionSpecs: the one table that places every array."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.mesh import BATCH_AXES

# Model axis name -> mesh axes it is split over. Mesh axes of size 1 are dropped from specs,
# so the same table serves every layout.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "length": ("sequence",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "head_dim": (),
    "position": (),
    "layers": ("pipeline",),
}


def logical_to_spec(names: tuple[str, ...], mesh: Mesh, rules=DEFAULT_RULES, where: str = "") -> P:
    """PartitionSpec for an array whose dimensions have these logical names.

    A mesh axis is used at most once per array (the first dimension that asks gets it).
    """
    used: set[str] = set()
    entries = []
    for name in names:
        if name not in rules:
            raise ValueError(f"{where or 'array'}: logical axis '{name}' matches no sharding rule; "
                             f"add '{name}' to the rules (known: {', '.join(sorted(rules))})")
        axes = tuple(a for a in rules[name] if mesh.shape[a] > 1 and a not in used)
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def tree_specs(axes_tree, mesh: Mesh, rules=DEFAULT_RULES):
    """PartitionSpecs for a tree whose leaves are tuples of logical names; errors name the path."""
    def one(path, names):
        return logical_to_spec(names, mesh, rules, where=jax.tree_util.keystr(path))
    return jax.tree_util.tree_map_with_path(one, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def named(mesh: Mesh, specs):
    """NamedShardings for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of a [batch, length] token array."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), mesh, rules))
