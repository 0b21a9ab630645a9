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
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics


class QuantizedTensor(NamedTuple):
    values: jax.Array  # [B, H, Tp, Dp] E4M3 (fp8) or bf16
    values_t: Optional[jax.Array]  # [B, H, Dp, Tp] or None
    inv_scale: jax.Array  # [B, H, Tp] f32


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
    x8, scales = numerics.quantize_tokens(x, precision)  # scales [B, H, Tp / 128]
    inv = 1.0 / numerics.expand_token_scales(scales, tp)
    return QuantizedTensor(x8, jnp.swapaxes(x8, 2, 3) if k_major else None, inv)


def pad_rows(x_BHT, tp: int, value=0.0):
    """Pad per-row statistics [B, H, T] to [B, H, Tp]."""
    return jnp.pad(x_BHT, ((0, 0), (0, 0), (0, tp - x_BHT.shape[2])), constant_values=value)


def pad_segment_ids(ids_BT, tp: int, fill: int):
    """Pad segment ids [B, T] to [B, Tp] with ``fill`` (padding is masked by bounds anyway)."""
    if ids_BT is None:
        return None
    ids = jnp.asarray(ids_BT, jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, tp - ids.shape[1])), constant_values=fill)
