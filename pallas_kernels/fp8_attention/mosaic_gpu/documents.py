"""Document tiles: the tiles that packed documents leave wholly visible.

With segment ids every tile of the Mosaic kernels takes the masked path (segment loads, a
compare and a select on every score). Where the query and key ids are one self-attention
array of contiguous runs (documents), a row sees exactly its document's keys (and, causal,
those up to itself), so a run of 64 query rows inside one document sees every key of a tile
that lies inside that document (and, causal, ends at or before the rows' first row). Such
tiles can take the unmasked path: their masked scores would all be kept, so the results are
bitwise the same.

Each kernel reads, per 64-token tile of its own loop's outer side, one 16-byte row of int32
(first, stop, 0, 0): the tiles it steps over whose indices lie in [first, stop) need no mask
(``first == stop``: none). The rows are computed here, in XLA, from the padded ids:

  forward and query passes (query rows [r0, r0 + 64), key tiles of ``key_tile``):
      key tiles inside [doc_first(r0), min(doc_end(r0), S, causal ? r0 + 1 : S))
  key pass (keys [k0, k0 + 64), query tiles of 64):
      query tiles inside [max(doc_first(k0), causal ? k0 + 63 : 0), min(doc_end(k0), T))
when every token of the 64 lies in one document and is not padding; else none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention.mosaic_gpu.forward import ForwardMask

TOKENS = 64  # the tokens of one row of bounds: a consumer warpgroup's rows (or keys)


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


def _rows(lo, hi, uniform):
    """[B, n, 4] int32 rows (first, stop, 0, 0); (0, 0) where not uniform or empty."""
    hi = jnp.maximum(hi, lo)
    lo, hi = jnp.where(uniform, lo, 0), jnp.where(uniform, hi, 0)
    zeros = jnp.zeros_like(lo)
    return jnp.stack([lo, hi, zeros, zeros], axis=-1).astype(jnp.int32)


def query_tiles(q_seg, kv_seg, mask: ForwardMask, key_tile: int):
    """Bounds rows [B, Tp / 64, 4] for a loop over key tiles of ``key_tile`` keys per 64
    query rows (the forward: 128; the query passes: their key tile)."""
    first, end, uniform = spans(q_seg, kv_seg, mask.t, mask.s)
    r0 = jnp.arange(0, q_seg.shape[1], TOKENS, dtype=jnp.int32)[None, :]
    doc_first, doc_end = first[:, ::TOKENS], end[:, ::TOKENS]
    stop = jnp.minimum(doc_end, mask.s)
    if mask.causal:
        stop = jnp.minimum(stop, r0 + 1)
    lo = -(-doc_first // key_tile)
    return _rows(lo, stop // key_tile, uniform)


def key_tiles(q_seg, kv_seg, mask: ForwardMask):
    """Bounds rows [B, Sp / 64, 4] for the key pass's loop over 64-row query tiles per 64
    keys (self-attention: the keys' documents are the rows')."""
    b, sp = kv_seg.shape
    if mask.t != mask.s or q_seg.shape[1] != sp:  # cross ids: no unmasked tile
        return jnp.zeros((b, sp // TOKENS, 4), jnp.int32)
    first, end, uniform = spans(q_seg, kv_seg, mask.t, mask.s)
    k0 = jnp.arange(0, sp, TOKENS, dtype=jnp.int32)[None, :]
    lo = first[:, ::TOKENS]
    if mask.causal:
        lo = jnp.maximum(lo, k0 + TOKENS - 1)
    stop = jnp.minimum(end[:, ::TOKENS], mask.t)
    return _rows(-(-lo // TOKENS), stop // TOKENS, uniform)
