"""Quantize pre-pass of the Mosaic GPU kernels: bf16/f32 -> e4m3 tiles, scales, layouts.

One XLA-fused pass per operand on the contract's scale rule (one power-of-two scale per
(batch, head, 128-token block), over the whole head dim):

  * ``values`` [B, H, Tp, D]: tokens padded with zeros to ``Tp`` (a multiple of 128);
  * ``values_t`` [B, H, D, Tp]: the K-major copy with tokens permuted per 16 as the FP8
    register regroup needs (:mod:`.regroup`), for operands on the B side of a dot that
    contracts over tokens (V in P @ V);
  * ``inv_tokens`` [B, H, Tp] f32: the decode factor 1 / scale of every token;
  * ``inv_rows`` [B, H, Tp / 128, 64] f32: each block's decode factor repeated 64 times, so
    a kernel reads a block's factor as a 64-row register vector with one small TMA copy;
  * ``nonfinite`` [B, H, Tp] bool: the token's row held a NaN or an Inf. Its values are
    zeroed (the amax skips non-finite values, so no scale changes) and the kernels poison
    the scores of the pairs it is part of instead (``numerics.poison``): a masked pair
    never multiplies a non-finite number, a visible one gets NaN.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.mosaic_gpu import regroup

BLOCK = numerics.SCALE_BLOCK
ROWS = 64  # query rows per consumer warpgroup


class MosaicOperand(NamedTuple):
    values: Optional[jax.Array]  # [B, H, Tp, D]
    values_t: Optional[jax.Array]  # [B, H, D, Tp], tokens permuted per 16
    inv_tokens: jax.Array  # [B, H, Tp]
    inv_rows: jax.Array  # [B, H, Tp / 128, 64]
    nonfinite: jax.Array  # [B, H, Tp] bool


def padded_length(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def nonfinite_tokens(x_BTHD, tp: int):
    """[B, H, Tp] bool: the token's row holds a NaN or an Inf (False on padding)."""
    bad = jnp.swapaxes(jnp.any(~jnp.isfinite(x_BTHD), axis=-1), 1, 2)
    return jnp.pad(bad, ((0, 0), (0, 0), (0, tp - bad.shape[2])))


def quantize(x_BTHD, *, values: bool = True, k_major: bool = False) -> MosaicOperand:
    """Cast ``x`` [B, T, H, D] to e4m3 with per-(batch, head, 128-token) scales."""
    b, t, h, d = x_BTHD.shape
    tp = padded_length(t)
    x = jnp.pad(jnp.swapaxes(x_BTHD, 1, 2), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    x = numerics.finite_or_zero(x)
    x8, scales = numerics.quantize_tokens(x, "fp8")  # scales [B, H, Tp / 128]
    inv = 1.0 / scales
    inv_tokens = jnp.repeat(inv, BLOCK, axis=-1)
    inv_rows = jnp.broadcast_to(inv[..., None], inv.shape + (ROWS,))
    values_t = regroup.permute_tokens(jnp.swapaxes(x8, 2, 3)) if k_major else None
    bad = nonfinite_tokens(x_BTHD, tp)
    return MosaicOperand(x8 if values else None, values_t, inv_tokens, inv_rows, bad)


def quantize_in_input_layout(
    x_BTHD, *, values: bool = True, k_major: bool = False
) -> MosaicOperand:
    """:func:`quantize` with the amax and the cast in the input's own layout and only the
    one-byte result transposed: bitwise the same operands. Measured slower end to end on
    the H200 (1.34 against 1.15 ms per forward at [4, 4096, 16, 128], docs/benchmarks.md);
    kept for the benchmark's comparison."""
    b, t, h, d = x_BTHD.shape
    tp = padded_length(t)
    n = tp // BLOCK
    x = jnp.pad(numerics.finite_or_zero(x_BTHD), ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    x = x.reshape(b, n, BLOCK, h, d)
    scales = numerics.pow2_scale(numerics.finite_amax(x, axis=(2, 4)))  # [B, n, H]
    x8 = numerics.quantize(x, scales[:, :, None, :, None])  # [B, n, 128, H, D]
    inv = jnp.swapaxes(1.0 / scales, 1, 2)  # [B, H, n]
    inv_tokens = jnp.repeat(inv, BLOCK, axis=-1)
    inv_rows = jnp.broadcast_to(inv[..., None], inv.shape + (ROWS,))
    out = jnp.transpose(x8, (0, 3, 1, 2, 4)).reshape(b, h, tp, d) if values else None
    values_t = None
    if k_major:  # [B, Tp/16, (h, t, e), H, D] -> [B, H, D, Tp/16, (t, h, e)]: regroup's order
        y = x8.reshape(b, tp // 16, 2, 4, 2, h, d)
        values_t = jnp.transpose(y, (0, 5, 6, 1, 3, 2, 4)).reshape(b, h, d, tp)
    return MosaicOperand(out, values_t, inv_tokens, inv_rows, nonfinite_tokens(x_BTHD, tp))


def pad_segment_ids(ids_BT, tp: int, fill: int):
    """Segment ids [B, T] -> [B, Tp] int32, padding with ``fill`` (padding never matches)."""
    ids = jnp.asarray(ids_BT, jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, tp - ids.shape[1])), constant_values=fill)
