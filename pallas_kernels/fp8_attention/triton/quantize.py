"""Quantize pre-pass: bf16/f32 -> E4M3 (or bf16) tiles for the attention kernels.

An XLA-fused pass that calls :func:`..numerics.quantize_tokens` (one power-of-two
scale per (batch, head, 128-token block), over the whole head dim) and lays the result
out the way the kernels read it:

  * ``values`` [B, H, Tp, Dp]: tokens padded with zeros to ``Tp`` (a multiple of the
    128-token scale block, hence of every kernel tile) and head dim padded with zeros to
    ``Dp`` (the next power of two: Triton loads need power-of-two element counts). Kernels
    never read out of bounds, and zero padding changes neither an amax nor a dot.
  * ``values_t`` [B, H, Dp, Tp]: the K-major (token-contiguous) copy, for the dots that
    contract over tokens (P^ V^, P^^T dO^, dS^ K^, dS^^T Q^), only when asked for.
  * ``inv_scale`` [B, H, Tp] f32: the decode factor 1 / scale of every token (constant
    over each 128-token block, hence over each kernel tile).
  * ``nonfinite`` [B, H, Tp] bool: the token's row held a NaN or an Inf; its values are
    zeroed, so that no masked (query, key) pair ever multiplies a non-finite number.
    :func:`with_poison` puts such tokens back into play where they belong: NaN added to
    the per-token factors of the scores (``inv_scale`` of Q or K; the kernels take each
    tile's decode factor with :func:`..common.tile_scalar`, which skips the NaN), so S_ij
    is NaN exactly for the visible pairs that touch a bad token.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics


class QuantizedTensor(NamedTuple):
    values: jax.Array  # [B, H, Tp, Dp] E4M3 (fp8) or bf16
    values_t: Optional[jax.Array]  # [B, H, Dp, Tp] or None
    inv_scale: jax.Array  # [B, H, Tp] f32 (NaN where poisoned, see with_poison)
    nonfinite: jax.Array  # [B, H, Tp] bool


def padded_length(n: int) -> int:
    """Tokens rounded up to the scale block (every tile divides it)."""
    return -(-n // numerics.SCALE_BLOCK) * numerics.SCALE_BLOCK


def padded_head_dim(d: int) -> int:
    """Head dim rounded up to a power of two (at least 16, the smallest dot tile)."""
    return max(16, 1 << (d - 1).bit_length())


def quantize(x_BTHD, precision: str, *, k_major: bool = False) -> QuantizedTensor:
    """Cast ``x`` [B, T, H, D] for the kernels; see the module docstring for the layout."""
    b, t, h, d = x_BTHD.shape
    tp, dp = padded_length(t), padded_head_dim(d)
    x = jnp.swapaxes(x_BTHD, 1, 2)  # [B, H, T, D]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, dp - d)))
    bad = numerics.nonfinite_tokens(x)
    # scales [B, H, Tp / 128]; the amax skips non-finite values, so zeroing them first
    # leaves every scale as it was
    x8, scales = numerics.quantize_tokens(numerics.finite_or_zero(x), precision)
    inv = 1.0 / numerics.expand_token_scales(scales, tp)
    return QuantizedTensor(x8, jnp.swapaxes(x8, 2, 3) if k_major else None, inv, bad)


def with_poison(x: QuantizedTensor, *bad_BHT) -> QuantizedTensor:
    """``x`` whose score factors are NaN for the tokens flagged in any of ``bad_BHT``."""
    bad = functools.reduce(jnp.logical_or, bad_BHT)
    return x._replace(inv_scale=x.inv_scale + numerics.poison(bad))


def pad_rows(x_BHT, tp: int, value=0.0):
    """Pad per-row statistics [B, H, T] to [B, H, Tp]."""
    return jnp.pad(x_BHT, ((0, 0), (0, 0), (0, tp - x_BHT.shape[2])), constant_values=value)


def pad_segment_ids(ids_BT, tp: int, fill: int):
    """Pad segment ids [B, T] to [B, Tp] with ``fill`` (padding is masked by bounds anyway)."""
    if ids_BT is None:
        return None
    ids = jnp.asarray(ids_BT, jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, tp - ids.shape[1])), constant_values=fill)
