"""Document tiles (`pallas_kernels.fp8_attention.mosaic_gpu.documents`): the tiles the
Mosaic kernels may run unmasked with packed documents are exactly those whose every
(query, key) pair the mask keeps, and the tiles a CTA visits hold every pair the mask keeps.
Pure XLA: runs on every jax version."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_attention.mosaic_gpu.documents import ROW_WORDS, key_tiles, query_tiles
from pallas_kernels.fp8_attention.mosaic_gpu.forward import ForwardMask
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import pad_segment_ids


def _documents(rng, b, t):
    """[b, t] ids of contiguous documents of random lengths (some longer than 128)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=rng.integers(0, 4), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right") * 7 + 3)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _visible(q_seg, kv_seg, t, s, causal):
    q, k = np.arange(q_seg.shape[1])[:, None], np.arange(kv_seg.shape[1])[None, :]
    vis = (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]) & (q < t) & (k < s)
    return vis & (k <= q) if causal else vis


def _wholly_visible(vis, rows, cols):
    """[B, n_rows, n_cols]: tiles of rows x cols whose every pair is visible."""
    b, tq, tk = vis.shape
    tiles = vis.reshape(b, tq // rows, rows, tk // cols, cols)
    return tiles.all(axis=(2, 4))


def _ranges(bounds):
    """[B, n, n_tiles] bool from the rows' (first, stop)."""
    b = np.asarray(bounds)
    n_tiles = 1 + max(1, int(b[..., 1].max()))
    j = np.arange(n_tiles)
    return (j >= b[..., :1]) & (j < b[..., 1:2])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("t", [512, 300, 1000])
def test_document_tiles_are_exactly_the_wholly_visible_tiles(t, causal):
    rng = np.random.default_rng(t + causal)
    b = 3
    ids = _documents(rng, b, t)
    tp = -(-t // 128) * 128
    q_seg, kv_seg = pad_segment_ids(ids, tp, -1), pad_segment_ids(ids, tp, -2)
    mask = ForwardMask(t=t, s=t, causal=causal, segments=True)
    vis = _visible(q_seg, kv_seg, t, t, causal)
    for key_tile in (64, 128):  # the query passes' and the forward's key tiles
        got = _ranges(query_tiles(q_seg, kv_seg, mask, key_tile))
        want = _wholly_visible(vis, 64, key_tile)
        width = min(got.shape[-1], want.shape[-1])
        assert not got[..., want.shape[-1] :].any()
        np.testing.assert_array_equal(got[..., :width], want[..., :width])
        assert want.any()  # documents long enough to hold whole tiles
    got = _ranges(key_tiles(q_seg, kv_seg, mask))  # [B, key tiles, query tiles]
    want = np.swapaxes(_wholly_visible(vis, 64, 64), 1, 2)
    width = min(got.shape[-1], want.shape[-1])
    assert not got[..., want.shape[-1] :].any()
    np.testing.assert_array_equal(got[..., :width], want[..., :width])


def test_cross_ids_leave_every_tile_masked():
    """Query and key ids that differ (or lengths T != S) give no unmasked tile."""
    ids = jnp.zeros((2, 256), jnp.int32)
    q_seg, kv_seg = pad_segment_ids(ids, 256, -1), pad_segment_ids(ids.at[:, 5].set(9), 256, -2)
    mask = ForwardMask(t=256, s=256, causal=False, segments=True)
    assert not np.asarray(query_tiles(q_seg, kv_seg, mask, 128))[..., :2].any()
    assert not np.asarray(key_tiles(q_seg, kv_seg, mask))[..., :2].any()
    same = ForwardMask(t=256, s=256, causal=False, segments=True)
    assert np.asarray(query_tiles(q_seg, pad_segment_ids(ids, 256, -2), same, 128))[..., :2].any()
    short = pad_segment_ids(ids[:, :200], 256, -2)
    cross = ForwardMask(t=256, s=200, causal=False, segments=True)
    assert not np.asarray(query_tiles(q_seg, short, cross, 128))[..., :2].any()
    assert not np.asarray(key_tiles(q_seg, short, cross))[..., :2].any()


def _cta_visible(vis, cta, tile):
    """[B, n_ctas, n_tiles]: tiles of ``tile`` inner tokens holding a pair visible to a
    CTA of ``cta`` outer tokens (``vis`` [B, outer, inner])."""
    b, n_out, n_in = vis.shape
    return vis.reshape(b, n_out // cta, cta, n_in // tile, tile).any(axis=(2, 4))


def _cta_ranges(bounds):
    """[B, n_ctas, n_tiles] bool from the rows' (lo, hi), one per CTA of two rows."""
    b = np.asarray(bounds)
    assert (b[:, 0::2, 2:4] == b[:, 1::2, 2:4]).all()  # both rows of a CTA agree
    assert not b[..., 4:].any() and b.shape[-1] == ROW_WORDS
    n_tiles = 1 + max(1, int(b[..., 3].max()))
    j = np.arange(n_tiles)
    return (j >= b[:, 0::2, 2:3]) & (j < b[:, 0::2, 3:4])


def _check_cta_ranges(got, want, exact):
    """Every tile with a visible pair lies in the range (and, ``exact``, nothing else)."""
    width = max(got.shape[-1], want.shape[-1])
    got = np.pad(got, ((0, 0), (0, 0), (0, width - got.shape[-1])))
    want = np.pad(want, ((0, 0), (0, 0), (0, width - want.shape[-1])))
    assert not (want & ~got).any(), "a visible pair outside the CTA's tiles"
    if exact:  # contiguous: the range spans the first to the last visible tile
        for bi in range(want.shape[0]):
            for c in range(want.shape[1]):
                idx = np.flatnonzero(want[bi, c])
                span = np.zeros(width, bool)
                if idx.size:
                    span[idx[0] : idx[-1] + 1] = True
                np.testing.assert_array_equal(got[bi, c], span)


@pytest.mark.parametrize("t", [512, 300, 1000])
def test_ctas_visit_the_tiles_their_documents_reach(t):
    """Ascending ids (packed documents, padding included): each CTA's range is exactly the
    span of the tiles with a pair its ids keep (causality is the kernels' own bound)."""
    rng = np.random.default_rng(t)
    ids = _documents(rng, 3, t)
    tp = -(-t // 128) * 128
    q_seg, kv_seg = pad_segment_ids(ids, tp, -1), pad_segment_ids(ids, tp, -2)
    mask = ForwardMask(t=t, s=t, causal=False, segments=True)
    vis = _visible(q_seg, kv_seg, t, t, False)
    for key_tile in (64, 128):
        got = _cta_ranges(query_tiles(q_seg, kv_seg, mask, key_tile))
        _check_cta_ranges(got, _cta_visible(vis, 128, key_tile), exact=True)
    got = _cta_ranges(key_tiles(q_seg, kv_seg, mask))
    _check_cta_ranges(got, _cta_visible(np.swapaxes(vis, 1, 2), 128, 64), exact=True)
    assert not got.all()  # documents leave tiles out


def test_cta_ranges_hold_every_visible_pair_for_any_ids():
    """Ids that do not ascend (a document id twice) fall back to every tile; cross ids of
    other lengths keep every visible pair too."""
    rng = np.random.default_rng(0)
    t, s = 384, 256
    repeated = jnp.asarray(np.tile(np.repeat([1, 2], 64), 3)[None], jnp.int32)
    q_seg, kv_seg = pad_segment_ids(repeated, t, -1), pad_segment_ids(repeated, t, -2)
    mask = ForwardMask(t=t, s=t, causal=False, segments=True)
    got = _cta_ranges(query_tiles(q_seg, kv_seg, mask, 64))
    assert got[..., : t // 64].all()
    q_ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, 300))), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(1, 6, (2, 200))), jnp.int32)
    q_seg, kv_seg = pad_segment_ids(q_ids, t, -1), pad_segment_ids(kv_ids, s, -2)
    mask = ForwardMask(t=300, s=200, causal=False, segments=True)
    vis = _visible(q_seg, kv_seg, 300, 200, False)
    _check_cta_ranges(
        _cta_ranges(query_tiles(q_seg, kv_seg, mask, 64)), _cta_visible(vis, 128, 64), exact=False
    )
    got = _cta_ranges(key_tiles(q_seg, kv_seg, mask))
    _check_cta_ranges(got, _cta_visible(np.swapaxes(vis, 1, 2), 128, 64), exact=False)
