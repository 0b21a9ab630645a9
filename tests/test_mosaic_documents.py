"""Document tiles (`pallas_kernels.fp8_attention.mosaic_gpu.documents`): the tiles the
Mosaic kernels may run unmasked with packed documents are exactly those whose every
(query, key) pair the mask keeps. Pure XLA: runs on every jax version."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_attention.mosaic_gpu.documents import key_tiles, query_tiles
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
    """[B, n, n_tiles] bool from rows (first, stop, 0, 0)."""
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
    assert not np.asarray(query_tiles(q_seg, kv_seg, mask, 128)).any()
    assert not np.asarray(key_tiles(q_seg, kv_seg, mask)).any()
    same = ForwardMask(t=256, s=256, causal=False, segments=True)
    assert np.asarray(query_tiles(q_seg, pad_segment_ids(ids, 256, -2), same, 128)).any()
    short = pad_segment_ids(ids[:, :200], 256, -2)
    cross = ForwardMask(t=256, s=200, causal=False, segments=True)
    assert not np.asarray(query_tiles(q_seg, short, cross, 128)).any()
    assert not np.asarray(key_tiles(q_seg, short, cross)).any()
