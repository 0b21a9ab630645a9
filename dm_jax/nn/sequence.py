"""Sequence helpers shared by the mixers and attention layers: packed-document positions,
rotary position embeddings and the short causal depthwise convolution.

Packed sequences carry `segment_ids_BT` (int, one id per document, contiguous runs). A new
document starts where the id changes; positions restart at 0 there, convolutions and
recurrent states do not reach across it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def document_starts(segment_ids_BT: jax.Array) -> jax.Array:
    """starts_BT: True at the first token of every document (and at t = 0)."""
    prev = jnp.concatenate([segment_ids_BT[:, :1] - 1, segment_ids_BT[:, :-1]], axis=1)
    return segment_ids_BT != prev


def positions(B: int, T: int, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """pos_BT: token index within its document (0..T-1 without segment ids)."""
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segment_ids_BT is None:
        return t
    start = jax.lax.cummax(jnp.where(document_starts(segment_ids_BT), t, 0), axis=1)
    return t - start


def apply_rope(x_BTHD: jax.Array, pos_BT: jax.Array, *, theta: float = 10000.0) -> jax.Array:
    """Rotary embedding on the last dim (D even), rotating halves (x1, x2) by pos * theta^(-2i/D).

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32.
    """
    D = x_BTHD.shape[-1]
    if D % 2:
        raise ValueError(f"x: RoPE needs an even last dim, got shape {x_BTHD.shape}")
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
    ang = pos_BT.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


class ShortConv(nnx.Module):
    """Depthwise causal convolution of width W along time: y_t = sum_i w_i * x_{t-i}.

    Taps that fall before the sequence start or in an earlier document read zero.
    """

    def __init__(self, features: int, width: int = 4, *, rngs: nnx.Rngs):
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        w = jax.random.uniform(rngs.params(), (width, features), jnp.float32, -1.0, 1.0)
        self.kernel = nnx.Param(w * width**-0.5)
        self.width = width

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        return short_conv(x_BTD, self.kernel.get_value(), segment_ids_BT)


def short_conv(x_BTD, kernel_WD, segment_ids_BT=None):
    """`ShortConv`'s convolution with kernel [W, D] (taps, channels) in x's dtype. Each
    channel is its own: several convolutions run as one on their concatenated channels."""
    T = x_BTD.shape[1]
    w = kernel_WD.astype(x_BTD.dtype)
    y = x_BTD * w[0]
    for i in range(1, w.shape[0]):
        xs = jnp.pad(x_BTD, [(0, 0), (i, 0), (0, 0)])[:, :T]  # x_{t-i}
        if segment_ids_BT is not None:
            ss = jnp.pad(segment_ids_BT, [(0, 0), (i, 0)], constant_values=-1)[:, :T]
            xs = jnp.where((ss == segment_ids_BT)[..., None], xs, 0)
        y = y + xs * w[i]
    return y
