"""The ragged exchange (parallel.ragged) over 4 devices, against numpy: rows reach the owners of
their groups sorted by local group then sender, and come home in their order, for balanced and
worst-case (everything to one owner) routing; and the CPU emulation equals the primitive's
documented example."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.parallel import ragged

DEVICES, GROUPS, ROWS = 4, 8, 6  # 2 groups a device, 6 rows a device
MESH = jax.make_mesh((DEVICES,), ("x",), devices=jax.devices()[:DEVICES])


def _map(fn, *args):
    spec = P("x")
    placed = [jax.device_put(a, NamedSharding(MESH, spec)) for a in args]
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=(spec,) * len(args), out_specs=spec))(*placed)


def _exchange(rows, groups):
    """(what each owner received [devices, most], its local groups' sizes, the rows home
    after each owner added 100 x (its device + 1))."""
    most = DEVICES * ROWS  # GROUPS / DEVICES >= 1 local group per owner: all rows can come to one

    def local(rows, groups):
        rows, groups = rows[0], groups[0]
        order = jnp.argsort(groups, stable=True)
        sizes = jnp.bincount(groups, length=GROUPS).astype(jnp.int32)
        r = ragged.routes(sizes, "x", DEVICES)
        got = ragged.send(rows[order], r, "x", most, ragged=False)
        mark = 100.0 * (jax.lax.axis_index("x") + 1)
        home = ragged.back(got + mark, ROWS, r, "x", ragged=False)
        return got[None], r.local_sizes[None], home[jnp.argsort(order)][None]

    return _map(local, rows, groups)


@pytest.mark.parametrize("case", ["spread", "all_to_one_owner"])
def test_rows_reach_their_owners_sorted_and_come_home(case):
    rng = np.random.default_rng(0)
    groups = (rng.integers(0, GROUPS, (DEVICES, ROWS)) if case == "spread"
              else rng.integers(4, 6, (DEVICES, ROWS))).astype(np.int32)  # groups 4, 5: device 2's
    rows = np.arange(DEVICES * ROWS, dtype=np.float32).reshape(DEVICES, ROWS)
    got, sizes, home = map(np.asarray, _exchange(rows, groups))
    local = GROUPS // DEVICES
    for owner in range(DEVICES):
        want = [rows[s][groups[s] == g] for g in range(owner * local, (owner + 1) * local) for s in range(DEVICES)]
        want = np.concatenate(want)
        np.testing.assert_array_equal(got[owner, :len(want)], want)
        assert not got[owner, len(want):].any()
        totals = np.bincount(groups.ravel(), minlength=GROUPS)
        np.testing.assert_array_equal(sizes[owner], totals[owner * local:(owner + 1) * local])
    np.testing.assert_array_equal(home, rows + 100.0 * (groups // local + 1))


def test_the_emulation_matches_the_documented_example():
    """lax.ragged_all_to_all's docstring example on an axis of 2."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    args = [np.array(a, np.float32 if i < 2 else np.int32) for i, a in enumerate((
        [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]]))]

    def local(*a):
        return ragged.emulated(*[x[0] for x in a], axis_name="x")[None]

    spec = P("x")
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(*placed)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


