"""Document tiles: the tiles that packed documents leave wholly visible, and the range of
tiles a CTA needs at all.

With segment ids every tile of the Mosaic kernels takes the masked path (segment loads, a
compare and a select on every score). Where the query and key ids are one self-attention
array of contiguous runs (documents), a row sees exactly its document's keys (and, causal,
those up to itself), so a run of 64 query rows inside one document sees every key of a tile
that lies inside that document (and, causal, ends at or before the rows' first row). Such
tiles can take the unmasked path: their masked scores would all be kept, so the results are
bitwise the same.

Tiles outside every document of a CTA's tokens are wholly masked: their scores are all
-inf, so they add exact zeros (P = 0, dS = 0) and leave the running max and sum as they
were. A CTA steps only over the tiles whose ids can meet its own: where each row's real ids
never decrease (packed documents), the tiles [lo, hi) whose id range meets the range of the
CTA's real ids (one pair of searches); elsewhere every tile. Causality narrows the
range further in the kernel, as before.

Each kernel reads, per 64-token tile of its own loop's outer side, one row of ROW_WORDS
int32 (first, stop, lo, hi, then zeros: 128 bytes, the shared-memory alignment of a TMA
copy; a 16-byte row at a 16-byte offset is a misaligned address on the GPU): the tiles it steps over whose indices lie in [first, stop) need no
mask (``first == stop``: none), and its CTA (two such tiles, 128 tokens) needs only the
tiles in [lo, hi). The rows are computed here, in XLA, from the padded ids:

  forward and query passes (query rows [r0, r0 + 64), key tiles of ``key_tile``):
      key tiles inside [doc_first(r0), min(doc_end(r0), S, causal ? r0 + 1 : S))
  key pass (keys [k0, k0 + 64), query tiles of 64):
      query tiles inside [max(doc_first(k0), causal ? k0 + 63 : 0), min(doc_end(k0), T))
when every token of the 64 lies in one document and is not padding; else none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention.mosaic_gpu.forward import ForwardMask

TOKENS = 64  # the tokens of one row of bounds: a consumer warpgroup's rows (or keys)
CTA_TOKENS = 2 * TOKENS  # the tokens of one CTA: two consumer warpgroups
ROW_WORDS = 32  # int32 per bounds row: 128 bytes (TMA's shared-memory alignment)
NO_ID = jnp.iinfo(jnp.int32).max  # stands for padding in the tiles' id ranges


def spans(q_seg, kv_seg, t: int, s: int):
    """(first [B, Tp], end [B, Tp], uniform [B, Tp / 64]): each query row's document
    [first, end) (contiguous runs of ids), and whether each run of 64 rows lies in one
    document with no padding. Uniform is False everywhere unless the query and key ids are
    the same array (T = S and equal ids): cross ids give no unmasked tile."""
    b, tp = q_seg.shape
    pos = jnp.arange(tp, dtype=jnp.int32)[None, :]
    prev = jnp.concatenate([q_seg[:, :1] - 1, q_seg[:, :-1]], axis=1)
    starts = q_seg != prev
    first = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
    nxt = jnp.concatenate([starts[:, 1:], jnp.ones((b, 1), bool)], axis=1)  # run ends at r
    end = jax.lax.cummin(jnp.where(nxt, pos + 1, tp), axis=1, reverse=True)
    same_array = False
    if t == s and tp == kv_seg.shape[1]:
        same_array = jnp.all(q_seg[:, :t] == kv_seg[:, :s])
    tiles = first.reshape(b, tp // TOKENS, TOKENS)
    one_document = tiles[..., 0] == tiles[..., -1]
    real = (pos.reshape(1, tp // TOKENS, TOKENS)[..., -1] < t) & jnp.ones((b, 1), bool)
    return first, end, one_document & real & same_array


def _id_range(seg, n: int, size: int):
    """(min, max) [B, len / size] of each tile's real ids (tokens before ``n``); NO_ID for
    a tile of padding only (so both ascend with ascending ids)."""
    b, length = seg.shape
    real = jnp.arange(length)[None, :] < n
    tiles = (b, length // size, size)
    low = jnp.where(real, seg, NO_ID).reshape(tiles).min(axis=-1)
    high = jnp.where(real, seg, jnp.iinfo(jnp.int32).min).reshape(tiles).max(axis=-1)
    return low, jnp.where(low == NO_ID, NO_ID, high)


def _ascending(seg, n: int):
    """[B] bool: the row's real ids (before ``n``) never decrease."""
    real = seg[:, :n]
    return jnp.all(real[:, 1:] >= real[:, :-1], axis=1)


def cta_ranges(outer_seg, inner_seg, n_outer: int, n_inner: int, inner_tile: int):
    """[B, Lp / 128, 2] int32 (lo, hi): the ``inner_tile``-token tiles of ``inner_seg`` a
    CTA of 128 ``outer_seg`` tokens must visit, every pair outside them masked by the ids.
    Where both rows' real ids ascend, the tiles whose id range meets the CTA's ((0, 0) for a
    CTA of padding only); elsewhere all of them."""
    n_tiles = inner_seg.shape[1] // inner_tile
    out_lo, out_hi = _id_range(outer_seg, n_outer, CTA_TOKENS)
    in_lo, in_hi = _id_range(inner_seg, n_inner, inner_tile)

    # ascending ids: both bounds ascend along the tiles (padding's NO_ID last); a search by
    # comparing all pairs (tens of tiles) is one fused op, where a binary search is a loop
    def search(a, v, side):
        return jnp.searchsorted(a, v, side=side, method="compare_all")

    first = jax.vmap(functools.partial(search, side="left"))(in_hi, out_lo)
    stop = jax.vmap(functools.partial(search, side="right"))(in_lo, out_hi)
    padding = jnp.arange(out_lo.shape[1])[None, :] * CTA_TOKENS >= n_outer
    first, stop = jnp.where(padding, 0, first), jnp.where(padding, 0, stop)
    ascending = (_ascending(outer_seg, n_outer) & _ascending(inner_seg, n_inner))[:, None]
    first = jnp.where(ascending, first, 0)
    stop = jnp.where(ascending, jnp.maximum(stop, first), n_tiles)
    return jnp.stack([first, stop], axis=-1).astype(jnp.int32)


def _rows(lo, hi, uniform, cta):
    """[B, n, ROW_WORDS] int32 rows (first, stop, lo, hi, 0, ...); (first, stop) = (0, 0)
    where not uniform or empty; (lo, hi) the CTA's range (``cta`` [B, n / 2, 2]), on both
    its rows."""
    hi = jnp.maximum(hi, lo)
    lo, hi = jnp.where(uniform, lo, 0), jnp.where(uniform, hi, 0)
    cta = jnp.repeat(cta, CTA_TOKENS // TOKENS, axis=1)
    rows = jnp.concatenate([jnp.stack([lo, hi], axis=-1), cta], axis=-1)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, ROW_WORDS - 4))).astype(jnp.int32)


def query_tiles(q_seg, kv_seg, mask: ForwardMask, key_tile: int):
    """Bounds rows [B, Tp / 64, ROW_WORDS] for a loop over key tiles of ``key_tile`` keys per 64
    query rows (the forward: 128; the query passes: their key tile)."""
    first, end, uniform = spans(q_seg, kv_seg, mask.t, mask.s)
    r0 = jnp.arange(0, q_seg.shape[1], TOKENS, dtype=jnp.int32)[None, :]
    doc_first, doc_end = first[:, ::TOKENS], end[:, ::TOKENS]
    stop = jnp.minimum(doc_end, mask.s)
    if mask.causal:
        stop = jnp.minimum(stop, r0 + 1)
    lo = -(-doc_first // key_tile)
    cta = cta_ranges(q_seg, kv_seg, mask.t, mask.s, key_tile)
    return _rows(lo, stop // key_tile, uniform, cta)


def key_tiles(q_seg, kv_seg, mask: ForwardMask):
    """Bounds rows [B, Sp / 64, ROW_WORDS] for the key pass's loop over 64-row query tiles per 64
    keys (self-attention: the keys' documents are the rows')."""
    b, sp = kv_seg.shape
    cta = cta_ranges(kv_seg, q_seg, mask.s, mask.t, TOKENS)
    if mask.t != mask.s or q_seg.shape[1] != sp:  # cross ids: no unmasked tile
        zeros = jnp.zeros((b, sp // TOKENS), jnp.int32)
        return _rows(zeros, zeros, False, cta)
    first, end, uniform = spans(q_seg, kv_seg, mask.t, mask.s)
    k0 = jnp.arange(0, sp, TOKENS, dtype=jnp.int32)[None, :]
    lo = first[:, ::TOKENS]
    if mask.causal:
        lo = jnp.maximum(lo, k0 + TOKENS - 1)
    stop = jnp.minimum(end[:, ::TOKENS], mask.t)
    return _rows(-(-lo // TOKENS), stop // TOKENS, uniform, cta)
