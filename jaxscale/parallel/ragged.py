"""Ragged token exchange over a mesh axis: each device sends every row of its operand to the
device that owns the row's group (an expert), nothing padded to a capacity, and gets the
processed rows back in its own order.

Rows are sorted by group (sizes_X of each, X = groups on all devices, X/G per device on an axis
of G). One all-gather of the [X] counts tells every device the whole [G, X] count matrix, from
which each computes every offset itself: its sends (group x's rows start at its own exclusive
cumulative count), where they land on the owner (the owner's rows sorted by its local group,
then by sender, so they arrive ready for grouped matmuls), and the reverse for the way back.
The receive buffer holds the most rows that can arrive, so no row is ever dropped: the caller
says how many (for experts: G devices x tokens x min(top_k, local experts), every device's
tokens all choosing this device's experts); rows past the received ones are zeros.

The exchange is `lax.ragged_all_to_all` where the backend has it (TPU, GPU). XLA:CPU does not
(UNIMPLEMENTED: ragged-all-to-all), so on CPU the same call is emulated with the same
arguments and result: each destination's rows gathered into a [G, rows] block with their
positions there, one all-to-all, and a scatter into the output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routes(NamedTuple):
    """A device's view of one exchange: its sends, its receives, and its local groups' sizes."""

    send_offsets: jax.Array   # [X] where each group's rows start in this device's sorted rows
    send_sizes: jax.Array     # [X] this device's rows per group
    land_offsets: jax.Array   # [X] where those rows land in their owner's buffer
    recv_offsets: jax.Array   # [G * X/G] where each (sender, local group) block lands here
    recv_sizes: jax.Array     # [G * X/G] rows from each sender per local group, sender-major
    back_offsets: jax.Array   # [G * X/G] where those rows started at their sender
    local_sizes: jax.Array    # [X/G] rows this device processes per local group (all senders)


def routes(sizes_X, axis: str, devices: int) -> Routes:
    """The offsets of an exchange of rows sorted by group (sizes_X: this device's rows per
    group) over `axis` (`devices` long), each device owning X/devices consecutive groups."""
    counts_GX = jax.lax.all_gather(sizes_X, axis)                    # [sender, group]
    local = sizes_X.shape[0] // devices
    me = jax.lax.axis_index(axis)
    totals = counts_GX.sum(0).reshape(devices, local)                # [owner, local group]
    group_start = (jnp.cumsum(totals, 1) - totals).reshape(-1)       # in the owner's buffer
    land_GX = group_start[None] + jnp.cumsum(counts_GX, 0) - counts_GX
    start_GX = jnp.cumsum(counts_GX, 1) - counts_GX                  # in each sender's rows
    mine = jax.lax.dynamic_slice_in_dim(jnp.arange(sizes_X.shape[0]), me * local, local)
    return Routes(start_GX[me], sizes_X, land_GX[me], land_GX[:, mine].reshape(-1),
                  counts_GX[:, mine].reshape(-1), start_GX[:, mine].reshape(-1), totals[me])


def send(rows_TD, r: Routes, axis: str, most: int, ragged: bool):
    """This device's rows (sorted by group) to their owners: [most, D] (`most`: the rows that
    can arrive), sorted by local group then sender, zeros past the rows received."""
    output = jnp.zeros((most, *rows_TD.shape[1:]), rows_TD.dtype)
    return _exchange(ragged)(rows_TD, output, r.send_offsets, r.send_sizes, r.land_offsets, r.recv_sizes,
                             axis_name=axis)


def back(processed_MD, rows: int, r: Routes, axis: str, ragged: bool):
    """The processed rows home: [rows, D] in the order `send` took them."""
    output = jnp.zeros((rows, *processed_MD.shape[1:]), processed_MD.dtype)
    return _exchange(ragged)(processed_MD, output, r.recv_offsets, r.recv_sizes, r.back_offsets, r.send_sizes,
                             axis_name=axis)


def _exchange(ragged: bool):
    """The primitive where the backend has it, else its emulation."""
    return jax.lax.ragged_all_to_all if ragged else emulated


def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str):
    """lax.ragged_all_to_all's result, from an all-to-all of [devices, rows] blocks (XLA:CPU
    has no ragged all-to-all). recv_sizes is implied by the senders' send_sizes."""
    del recv_sizes
    devices = jax.lax.axis_size(axis_name)
    rows, slices = operand.shape[0], input_offsets.shape[0] // devices

    def block(starts, sizes, lands):
        """One destination's rows: operand rows and their places there (len(output): none)."""
        ends = jnp.cumsum(sizes)
        p = jnp.arange(rows)
        q = jnp.minimum(jnp.searchsorted(ends, p, side="right"), slices - 1)
        within = p - (ends[q] - sizes[q])
        valid = p < ends[-1]
        source = jnp.where(valid, starts[q] + within, 0)
        return jnp.where(valid[:, None], operand[source].reshape(rows, -1), 0), jnp.where(
            valid, lands[q] + within, output.shape[0])

    split = [x.reshape(devices, slices) for x in (input_offsets, send_sizes, output_offsets)]
    data, places = jax.vmap(block)(*split)
    data = jax.lax.all_to_all(data, axis_name, 0, 0, tiled=True)
    places = jax.lax.all_to_all(places, axis_name, 0, 0, tiled=True)
    flat = output.reshape(output.shape[0], -1).at[places.reshape(-1)].set(
        data.reshape(-1, data.shape[-1]), mode="drop")
    return flat.reshape(output.shape)
