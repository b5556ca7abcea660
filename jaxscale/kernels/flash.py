"""Blockwise ("flash") attention in plain JAX, with its own backward: memory O(L·d), not O(L²).

The forward walks key blocks for each query block, keeping an online softmax (running max and
sum, FlashAttention's recurrence); it saves only the output and each row's log-sum-exp. The
backward (jax.custom_vjp) recomputes each block's probabilities from the saved log-sum-exp
(FlashAttention-2's order: key blocks outside, query blocks inside). No [L, L] array exists in
either direction; the largest temporary is one [block_q, block_k] score tile per head.

What a query sees is data, not a shape: key j is visible to query i when k_pos[j] <= q_pos[i],
with document masking q_seg[i] == k_seg[j], and with a sliding window of W keys (Gemma 2/3's
local layers) q_pos[i] - k_pos[j] < W. A tile with nothing visible is skipped (lax.cond), so
causal attention does about half the work of the full square, blocks of other documents are
never computed, and the zig-zag layout of context parallelism (positions out of order) needs
nothing special. Within a tile the mask is a bias added to the scores, HIDDEN
(below EMPTY, where the running max starts) on invisible keys: their exp underflows to exactly 0,
also in a row that has seen nothing yet, so no select on the tile and no inf - inf (NaN).
Soft-capping (Gemma 2's attention logits) replaces each scaled score s by C·tanh(s / C) before the
mask; the backward multiplies by its slope, 1 - tanh², read back from the capped score.

`attention`, where tokens are in order, does not even visit the key tiles a window leaves wholly
out: each query tile walks only the `band` of key tiles that can reach back into its window (and
the backward each key tile the band of query tiles ahead), so work and loop trips grow with L·W.

`forward` and `backward` work on any key range against any query range, given the log-sum-exp of
the whole row: ring attention (parallel.context) calls them once per visiting block.
Layouts are heads-major, so each tile's scores [B, K, G, bq, bk] are the natural output of a dot
batched over (B, K): q [B, K, G, Lq, E] (G query heads share each of the K key/value heads), k and
v [B, K, Lk, E] (v's width may differ from q's and k's: multi-head latent attention's), the
log-sum-exp [B, K, G, Lq] float32, positions and segment ids [B, L] int32.
`group`, `heads_major` and `ungroup` convert from and to the model's [B, L, heads, E], once per call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

EMPTY = -1e30  # the log-sum-exp of a row that saw nothing in a key range (finite: no NaN on merge)
HIDDEN = 2 * EMPTY  # the bias on an invisible key's score: exp(HIDDEN - max) is 0 for any max >= EMPTY
BLOCK = 512    # default tile edge (model.attention.block_size)
SCOPE = "flash_attention"  # the kernel's name in its HLO's op_name metadata (benchmarks/cpu_profile.py)


def block_for(length: int, target: int) -> int:
    """The largest tile edge <= target that divides length."""
    return next(b for b in range(min(target, length), 0, -1) if length % b == 0)


def _loop(count: int, body, carry):
    """body(i, carry) for i in 0..count-1, as a while loop. Not fori_loop: with static bounds that
    becomes a scan, and when a custom_vjp's forward sits in an outer scan (the layer scan) whose
    inputs it closes over (positions, segment ids), JAX's partial evaluation of that scan splits
    these loops and stacks their masks as residuals ([blocks, blocks, tile, tile] each: O(L²) again,
    measured). A while loop is never split; nothing differentiates through these loops anyway."""
    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < count, step, (0, carry))[1]


def _rows(x, start, size, axis=-2):
    """Rows start .. start+size-1 of the length axis: -2 of [..., L, E], -1 of [..., L]."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put_rows(x, rows, start, axis=-2):
    return jax.lax.dynamic_update_slice_in_dim(x, rows.astype(x.dtype), start, axis=axis)


def _walk(count: int, band: int, origin, body, carry):
    """body(index, inside, carry) for the tiles one row (or column) of tiles visits: all `count`
    (band 0; inside is True), or the `band` tiles origin .. origin + band - 1, of which those
    outside 0 .. count - 1 have inside False (their slices wrap or clamp: body must skip them)."""
    if not band:
        return _loop(count, lambda t, c: body(t, True, c), carry)
    return _loop(band, lambda t, c: body(origin + t, (origin + t >= 0) & (origin + t < count), c), carry)


def _visible(q_pos, k_pos, q_seg, k_seg, window: int):
    """[B, bq, bk] bool: causal by position, within one document by segment id, and (window > 0)
    fewer than `window` positions back."""
    causal = q_pos[:, :, None] >= k_pos[:, None, :]
    if window:
        causal = causal & (q_pos[:, :, None] - k_pos[:, None, :] < window)
    return causal & (q_seg[:, :, None] == k_seg[:, None, :])


def _bias(visible):
    """[B, 1, 1, bq, bk] float32 to add to a tile's scores: 0 where visible, else HIDDEN."""
    return jnp.where(visible, 0.0, HIDDEN)[:, None, None]


def soft_cap(z, cap: float):
    """cap·tanh(z / cap): z squashed into (-cap, cap), near z where |z| << cap; z itself for cap 0.
    Attention scores here and in decoding, the logits in models.vocab."""
    return cap * jnp.tanh(z / cap) if cap else z


def uncap(dz, capped, cap: float):
    """The gradient wrt z before the cap, from dz wrt capped = soft_cap(z, cap): times the cap's
    slope 1 - tanh², which is 1 - (capped / cap)²."""
    return dz * (1.0 - jnp.square(capped / cap)) if cap else dz


def _scores(q, k, softcap: float):
    """[B, K, G, bq, bk] float32, scaled, then soft-capped at `softcap` (0: not)."""
    s = jnp.einsum("bkgqe,bkse->bkgqs", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return soft_cap(s, softcap)


def band_for(window: int, tile: int, tiles: int) -> int:
    """How many key tiles of edge `tile` a query tile's window reaches (its own and
    ceil((window - 1) / tile) before it), or 0 (visit all) without a window or where it reaches
    all `tiles`."""
    reach = -(-(window - 1) // tile) + 1
    return reach if window and reach < tiles else 0


def _forward_rows(q, q_pos, q_seg, k, v, k_pos, k_seg, block_k, window, softcap, keys):
    """(out [B, K, G, bq, E] float32, lse [B, K, G, bq]) of one query block against the key
    blocks keys = (band, origin) walks (see _walk)."""
    B, K, G, bq, _ = q.shape

    def key_block(j, inside, carry):
        start = j * block_k
        vis = _visible(q_pos, _rows(k_pos, start, block_k, -1), q_seg, _rows(k_seg, start, block_k, -1), window)

        def update(carry):
            out, run_max, run_sum = carry
            s = _scores(q, _rows(k, start, block_k), softcap) + _bias(vis)
            new_max = jnp.maximum(run_max, s.max(-1))
            p = jnp.exp(s - new_max[..., None])
            correction = jnp.exp(run_max - new_max)
            pv = jnp.einsum("bkgqs,bkse->bkgqe", p.astype(v.dtype), _rows(v, start, block_k),
                            preferred_element_type=jnp.float32)
            return out * correction[..., None] + pv, new_max, run_sum * correction + p.sum(-1)

        return jax.lax.cond(inside & vis.any(), update, lambda c: c, carry)

    start = (jnp.zeros((B, K, G, bq, v.shape[-1]), jnp.float32), jnp.full((B, K, G, bq), EMPTY, jnp.float32),
             jnp.zeros((B, K, G, bq), jnp.float32))
    out, run_max, run_sum = _walk(k.shape[2] // block_k, *keys, key_block, start)
    seen = run_sum > 0
    safe_sum = jnp.where(seen, run_sum, 1.0)
    return out / safe_sum[..., None], jnp.where(seen, run_max + jnp.log(safe_sum), EMPTY)


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q: int, block_k: int, window: int = 0,
            softcap: float = 0.0, band: int = 0):
    """(out [B, K, G, Lq, E] float32, lse [B, K, G, Lq] float32) of q against these keys, with a
    sliding window of `window` positions (0: none) and scores soft-capped at `softcap` (0: not).
    Rows that see none of them get out 0 and lse EMPTY. band > 0 (tokens in order, query row r
    and key row r one token, block_q == block_k): query tile i visits only key tiles
    i - band + 1 .. i."""

    def query_block(i, carry):
        out, lse = carry
        start = i * block_q
        o, m = _forward_rows(_rows(q, start, block_q), _rows(q_pos, start, block_q, -1),
                             _rows(q_seg, start, block_q, -1), k, v, k_pos, k_seg, block_k, window, softcap,
                             (band, i - band + 1))
        return _put_rows(out, o, start), _put_rows(lse, m, start, -1)

    start = jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32), jnp.zeros(q.shape[:-1], jnp.float32)
    return _loop(q.shape[3] // block_q, query_block, start)


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint key ranges as one (the online softmax across ranges)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None], lse


def delta(out, d_out):
    """Each row's sum of out * d_out, [B, K, G, L] float32: the softmax backward's correction."""
    return jnp.einsum("...e,...e->...", out.astype(jnp.float32), d_out.astype(jnp.float32))


def backward(q, k, v, q_pos, k_pos, q_seg, k_seg, lse, row_delta, d_out, block_q: int, block_k: int, into=None,
             window: int = 0, softcap: float = 0.0, band: int = 0):
    """(dq [B, K, G, Lq, E], dk, dv [B, K, Lk, E]), float32: these keys' share of the gradients,
    given each row's log-sum-exp and delta over all the keys it sees, added to `into` (running
    sums of the three, float32; None: zeros) without another copy of them. `window`, `softcap`
    and `band` as in `forward` (band > 0: key tile j visits only query tiles j .. j + band - 1)."""

    def key_block(j, carry):
        dq, dk, dv = carry
        k_start = j * block_k
        k_j, v_j = _rows(k, k_start, block_k), _rows(v, k_start, block_k)
        k_pos_j, k_seg_j = _rows(k_pos, k_start, block_k, -1), _rows(k_seg, k_start, block_k, -1)

        def query_block(i, inside, inner):
            start = i * block_q
            vis = _visible(_rows(q_pos, start, block_q, -1), k_pos_j, _rows(q_seg, start, block_q, -1), k_seg_j,
                           window)

            def update(inner):
                dq, dk_j, dv_j = inner
                q_i, do_i = _rows(q, start, block_q), _rows(d_out, start, block_q)
                s = _scores(q_i, k_j, softcap)
                p = jnp.exp(s + _bias(vis) - _rows(lse, start, block_q, -1)[..., None])
                dv_j = dv_j + jnp.einsum("bkgqs,bkgqe->bkse", p.astype(do_i.dtype), do_i,
                                         preferred_element_type=jnp.float32)
                dp = jnp.einsum("bkgqe,bkse->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
                ds = p * (dp - _rows(row_delta, start, block_q, -1)[..., None])
                ds = uncap(ds, s, softcap) * q.shape[-1] ** -0.5
                dk_j = dk_j + jnp.einsum("bkgqs,bkgqe->bkse", ds.astype(q_i.dtype), q_i,
                                         preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("bkgqs,bkse->bkgqe", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32)
                return _put_rows(dq, _rows(dq, start, block_q) + dq_i, start), dk_j, dv_j

            return jax.lax.cond(inside & vis.any(), update, lambda c: c, inner)

        # dK and dV rows of this key block start from their running sums (into), kept in the loop.
        dq, dk_j, dv_j = _walk(q.shape[3] // block_q, band, j, query_block,
                               (dq, _rows(dk, k_start, block_k), _rows(dv, k_start, block_k)))
        return dq, _put_rows(dk, dk_j, k_start), _put_rows(dv, dv_j, k_start)

    if into is None:
        into = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return _loop(k.shape[2] // block_k, key_block, into)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attend(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, masks):
    return _attend_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, masks)[0]


def _attend_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, masks):
    """masks: the static (window, softcap, band) of `forward`."""
    out, lse = forward(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, *masks)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _attend_bwd(block_q, block_k, masks, residuals, d_out):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = residuals
    dq, dk, dv = backward(q, k, v, q_pos, k_pos, q_seg, k_seg, lse, delta(out, d_out), d_out, block_q, block_k,
                          None, *masks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def group(q_BLHE, kv_heads: int):
    """[B, L, H, E] -> [B, K, G, L, E]: heads-major, the G query heads that share each key/value head."""
    b, length, h, e = q_BLHE.shape
    return q_BLHE.reshape(b, length, kv_heads, h // kv_heads, e).transpose(0, 2, 3, 1, 4)


def heads_major(x_BLKE):
    """[B, L, K, E] -> [B, K, L, E] (keys, values)."""
    return x_BLKE.transpose(0, 2, 1, 3)


def ungroup(out_BKGLE):
    """[B, K, G, L, E] -> [B, L, H, E]: the inverse of `group`."""
    b, kv_heads, g, length, e = out_BKGLE.shape
    return out_BKGLE.transpose(0, 3, 1, 2, 4).reshape(b, length, kv_heads * g, e)


def attention(q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL, q_seg_BL=None, k_seg_BL=None, block: int = BLOCK,
              window: int = 0, softcap: float = 0.0):
    """Grouped-query attention, [B, Lq, H, E] out in q's dtype: key j visible to query i when
    k_pos[j] <= q_pos[i], (with segment ids) both lie in one segment and (window > 0)
    q_pos[i] - k_pos[j] < window; scores soft-capped at `softcap` (0: not). Tiles of
    block_for(L, block) rows; gradients by the blockwise backward.

    With a window and as many keys as queries, the tokens must be in order: query row r and key
    row r one token, positions rising along the row within each document (they may restart where
    the segment id changes). Then each query tile visits only the band of key tiles its window
    reaches (band_for)."""
    q_seg_BL = jnp.zeros_like(q_pos_BL) if q_seg_BL is None else q_seg_BL
    k_seg_BL = jnp.zeros_like(k_pos_BL) if k_seg_BL is None else k_seg_BL
    block_q, block_k = block_for(q_BLHE.shape[1], block), block_for(k_BLKE.shape[1], block)
    in_order = q_BLHE.shape[1] == k_BLKE.shape[1]
    band = band_for(window, block_q, q_BLHE.shape[1] // block_q) if in_order else 0
    with jax.named_scope(SCOPE):
        out = _attend(group(q_BLHE, k_BLKE.shape[2]), heads_major(k_BLKE), heads_major(v_BLKE),
                      q_pos_BL, k_pos_BL, q_seg_BL, k_seg_BL, block_q, block_k, (window, softcap, band))
    return ungroup(out)
