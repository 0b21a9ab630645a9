"""Which (query, key) pairs may attend: bounds, causality and packed-sequence segments.

One definition shared by the high-precision reference and the blockwise emulation, so the
two cannot disagree about a mask. Causal masking is top-left aligned (query i sees keys
j <= i), as in ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class MaskInfo(NamedTuple):
    t: int  # number of real queries
    s: int  # number of real keys
    causal: bool
    q_segment_ids: Optional[jax.Array]  # [B, T] int32 or None
    kv_segment_ids: Optional[jax.Array]  # [B, S] int32 or None

    @classmethod
    def create(cls, t, s, *, causal, segment_ids):
        q_ids, kv_ids = split_segment_ids(segment_ids)
        return cls(t, s, causal, q_ids, kv_ids)


def split_segment_ids(segment_ids):
    """None | [B, T] | (q_ids [B, T], kv_ids [B, S]) -> (q_ids, kv_ids) (or (None, None))."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_ids, kv_ids = segment_ids
    else:
        q_ids = kv_ids = segment_ids
    return jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)


def _take_padded(ids_BN, pos, fill):
    """ids[:, pos] with positions past the end reading ``fill``."""
    n = ids_BN.shape[1]
    inside = pos < n
    vals = jnp.take(ids_BN, jnp.where(inside, pos, 0), axis=1)
    return jnp.where(inside, vals, fill)


def tile_mask(info: MaskInfo, q_pos, k_pos):
    """Boolean mask ``[B or 1, *q_pos.shape, len(k_pos)]``: True where attention is allowed.

    ``q_pos`` holds query positions (any shape), ``k_pos`` a 1-D run of key positions; both
    may run past the real lengths (padding), which are masked out.
    """
    qp = q_pos[..., None]
    valid = (qp < info.t) & (k_pos < info.s)
    if info.causal:
        valid = valid & (qp >= k_pos)
    valid = valid[None]
    if info.q_segment_ids is not None:
        q_ids = _take_padded(info.q_segment_ids, q_pos, -1)[..., None]
        k_ids = _take_padded(info.kv_segment_ids, k_pos, -2)
        k_ids = k_ids.reshape((k_ids.shape[0],) + (1,) * q_pos.ndim + (k_pos.shape[0],))
        valid = valid & (q_ids == k_ids)
    return valid
