"""FP8 formats and scale rules: the single definition both kernels and reference use.

It lives beside the kernels because every backend implements these rules in its tiles;
``dm_jax.numerics`` re-exports it for the library and the pure-JAX reference.

Contract (docs/numerics.md):
  * every FP8 operand is ``float8_e4m3fn``; accumulators are FP32 (on Hopper the kernels'
    default sums one tile's products in the FP8 tensor core first: docs/numerics.md);
  * scales are powers of two, ``scale = 2^floor(log2(448 / amax))``, ``amax == 0 -> 1``,
    so ``x * scale`` never exceeds 448 and decoding (``x8 / scale``) is exact;
  * values are clipped to +-448 before every cast (the GPU saturates, interpret mode and
    XLA on the CPU would produce NaN);
  * NaN and Inf propagate: ``amax`` ignores non-finite values (one bad element must not
    poison the scale of its whole block), and a non-finite element encodes as NaN;
  * Q, K, V, dO: one scale per (batch, head, block of ``SCALE_BLOCK`` tokens);
  * P: fixed scale ``P_SCALE`` (P lies in [0, 1]); dS: one dynamic scale per kernel tile;
  * masked (query, key) pairs contribute nothing, NaN included: a token whose Q, K, V or dO
    row holds a non-finite value is zeroed for the dots and instead poisons the scores of
    the pairs it is part of (:func:`nonfinite_tokens`, :func:`poison`), so NaN reaches
    exactly the queries that see it.

Every function here is written with plain ``jnp``/``lax`` element-wise ops and reductions so
that Pallas kernels can call the same code on their tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BLOCK = 128  # tokens per Q/K/V/dO scale block
P_SCALE = 256.0  # fixed scale of the probabilities, P * 256 <= 256 < 448
PRECISIONS = ("fp8", "bf16")
# How the softmax backward forms delta_i (docs/numerics.md): sum_j P_ij dP^_ij from the
# operands the backward uses, rowsum(dO^ * O), or rowsum(dO * O) as other kernels do.
DELTA_MODES = ("matched", "do_matched", "stale")

# f32 bit layout used to take floor(log2(.)) exactly (no transcendental rounding).
_MANTISSA_BITS = 23
_EXPONENT_BIAS = 127
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MAX_SCALE_EXPONENT = 126  # keep both scale and 1/scale normal f32 numbers


def finite_amax(x, axis=None, keepdims=False):
    """max |x| over ``axis`` in f32, ignoring NaN and +-Inf (they propagate elementwise)."""
    ax = jnp.abs(x.astype(jnp.float32))
    # `ax < inf` is False for NaN and Inf alike.
    return jnp.max(jnp.where(ax < jnp.inf, ax, 0.0), axis=axis, keepdims=keepdims)


def _split_pow2(value):
    """value = m * 2^e with m in [1, 2): (mantissa field of m as f32 bits, e). Static."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return bits & _MANTISSA_MASK, (bits >> _MANTISSA_BITS) - _EXPONENT_BIAS


def pow2_scale(amax, fmt_max=FP8_MAX):
    """Power-of-two scale ``2^floor(log2(fmt_max / amax))``; ``amax == 0 -> 1``.

    Computed from the bits of ``amax`` so the floor is exact: for amax = m * 2^e and
    fmt_max = m_f * 2^e_f (m, m_f in [1, 2)), floor(log2(fmt_max / amax)) is e_f - e when
    m <= m_f and e_f - e - 1 otherwise (E4M3: 448 = 1.75 * 2^8; E5M2: 57344 = 1.75 * 2^15).
    Exponents are clamped to +-126 so that the scale and its inverse stay normal numbers
    (tiny or denormal amax get the largest scale).
    """
    fmt_mantissa, fmt_exponent = _split_pow2(float(fmt_max))
    amax = jnp.asarray(amax, jnp.float32)
    safe = jnp.maximum(amax, jnp.float32(2.0**-_MAX_SCALE_EXPONENT))  # smallest normal
    bits = lax.bitcast_convert_type(safe, jnp.int32)
    exponent = jnp.right_shift(bits, _MANTISSA_BITS) - _EXPONENT_BIAS
    mantissa = jnp.bitwise_and(bits, _MANTISSA_MASK)
    scale_exp = jnp.where(
        mantissa <= fmt_mantissa, fmt_exponent - exponent, fmt_exponent - 1 - exponent
    )
    scale_exp = jnp.clip(scale_exp, -_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    scale = lax.bitcast_convert_type(
        jnp.left_shift(scale_exp + _EXPONENT_BIAS, _MANTISSA_BITS).astype(jnp.int32), jnp.float32
    )
    return jnp.where(amax > 0, scale, jnp.float32(1.0))


def quantize(x, scale, dtype=FP8_DTYPE):
    """``x * scale`` clipped to the format's max (448 for E4M3) and cast to ``dtype``.

    Non-finite ``x`` encodes as NaN. ``scale`` broadcasts against ``x``. The clip happens
    before the cast because the GPU saturates while interpret mode and XLA produce NaN
    for out-of-range finite values.
    """
    fmt_max = FP8_MAX if dtype == FP8_DTYPE else float(jnp.finfo(dtype).max)
    y = x.astype(jnp.float32) * scale
    clipped = jnp.clip(y, -fmt_max, fmt_max)
    # Inf would be clipped to the max (silently hiding it), and so may NaN: the GPU's
    # min/max return the operand that is a number. Encode both as NaN.
    y = jnp.where(jnp.abs(y) < jnp.inf, clipped, jnp.nan)
    return y.astype(dtype)


def quantize_by_own_amax(x, scale, dtype=FP8_DTYPE):
    """``quantize(x, scale)`` where ``scale = pow2_scale(amax)`` of x's own finite amax (a
    dS tile): bitwise the same on finite values, NaN where x is not finite (the NaN's sign
    bit may differ), in fewer ops (a kernel does this for every dS element).

    scale is a power of two <= fmt_max / amax, so every finite |x * scale| is exactly at
    most fmt_max and the clip cannot change a bit; y + 0 * y is y for every finite y and
    NaN for Inf and NaN, so it encodes non-finite values as NaN in one fused multiply-add.
    """
    y = x.astype(jnp.float32) * scale
    return (y + y * jnp.float32(0.0)).astype(dtype)


def quantize_finite_by_own_amax(x, scale, dtype=FP8_DTYPE):
    """``quantize_by_own_amax`` for a tile known to hold no Inf (finite values, or NaN where
    a poisoned pair is): the plain cast, one multiply-add per element fewer. Bitwise the
    same there: the cast keeps NaN, and no finite ``x * scale`` exceeds the format's max."""
    return (x.astype(jnp.float32) * scale).astype(dtype)


def nonfinite_tokens(x_BHTD):
    """[B, H, T] bool: the token's row (over the head dim) holds a NaN or an Inf."""
    return jnp.any(~jnp.isfinite(x_BHTD), axis=-1)


def finite_or_zero(x):
    """x with every NaN and Inf replaced by 0 (the value a masked pair may safely meet)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def poison(bad):
    """f32 0 where ``bad`` is False, NaN where True: added to (or multiplied into) the
    per-token score factors so that S_ij is NaN exactly for the pairs that touch a bad
    token; the mask then turns the pairs nobody may see into -inf, as for any score.

    Pairs a query sees get NaN in S, hence in its P row, its lse and its output row, as a
    NaN in its Q or in a visible K would give; no masked pair ever multiplies a NaN.
    """
    return jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0.0))


def fixed_order_sum(x):
    """Sum over the last axis in one fixed order: a balanced tree of two-element adds.

    ``jnp.sum`` lets XLA pick the order (vector width, fusion), so two programs that sum
    the same numbers can round differently, and a 1-ulp difference in delta flips FP8
    roundings of dS downstream. Element-wise adds are never reassociated, so this order
    is the same in every program and on every CPU; padding to a power of two adds exact
    zeros.
    """
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


@jax.jit
def row_dot(a, b):
    """``sum_d a_d b_d`` over the last axis in f32, in :func:`fixed_order_sum`'s order.

    Jitted as one unit so that an eager caller (a backward run op by op under
    ``jax.grad``) and a traced one fuse it alike: with the multiply fused into the first
    adds, a CPU with FMA contracts both programs the same way. Used for every softmax
    delta that both the kernels' CPU twin and the emulation compute, so the two agree
    to the bit.
    """
    return fixed_order_sum(a.astype(jnp.float32) * b.astype(jnp.float32))


def upcast(x8):
    """f32 view of an FP8/bf16 operand that keeps its rounding under XLA's optimizer.

    XLA on the GPU treats a round trip f32 -> narrow -> f32 as excess precision it may
    remove (``xla_allow_excess_precision``), which silently turns an emulated FP8 operand
    back into the unquantized value. The optimization barrier keeps the narrow cast.
    (Inside Pallas kernels casts are kept as written; this is for XLA-side code.)
    """
    return lax.optimization_barrier(x8).astype(jnp.float32)


def dequantize(x8, scale):
    """Decode: ``x8 / scale`` as f32 (exact, the scale is a power of two)."""
    return upcast(x8) * (1.0 / scale)


def cast_operand(x, scale, precision):
    """Cast a (pre-scaled-by-``scale``) operand for a dot in ``precision``.

    fp8: ``quantize(x, scale)``; bf16: plain bf16 cast (``scale`` must be 1).
    """
    if precision == "fp8":
        return quantize(x, scale)
    if precision == "bf16":
        return x.astype(jnp.bfloat16)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def operand_dtype(precision):
    return FP8_DTYPE if precision == "fp8" else jnp.bfloat16


def cast_probabilities(p, precision):
    """``cast_operand(p, p_scale(precision), precision)`` for probabilities, in fewer ops.

    p in [0, 1] (or NaN) times P_SCALE = 256 is never above 448 nor infinite, so the clip
    and the Inf check of :func:`quantize` cannot change a bit: a plain cast gives the same
    code (a kernel does this for every P element of every tile).
    """
    if precision == "fp8":
        return (p * jnp.float32(P_SCALE)).astype(FP8_DTYPE)
    return cast_operand(p, p_scale(precision), precision)


def p_scale(precision):
    """Fixed scale of P for the P@V and P^T@dO dots."""
    return jnp.float32(P_SCALE if precision == "fp8" else 1.0)


def tile_scale(x, precision, axis=None, keepdims=False):
    """Dynamic scale of dS tiles (amax over ``axis``): pow2 of the amax for fp8, 1 for bf16."""
    if precision == "fp8":
        return pow2_scale(finite_amax(x, axis=axis, keepdims=keepdims))
    return jnp.float32(1.0)


def token_block_scales(x_BHTD, precision="fp8", block=SCALE_BLOCK):
    """Scales per (batch, head, ``block``-token block): ``[B, H, ceil(T / block)]`` f32.

    The amax runs over the block's tokens and the whole head dim; a trailing partial
    block uses only its valid tokens. bf16 gets all-ones scales.
    """
    b, h, t, d = x_BHTD.shape
    n_blocks = -(-t // block)
    if precision == "bf16":
        return jnp.ones((b, h, n_blocks), jnp.float32)
    pad = n_blocks * block - t
    x = jnp.pad(x_BHTD.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    amax = finite_amax(x.reshape(b, h, n_blocks, block * d), axis=-1)
    return pow2_scale(amax)


def expand_token_scales(scales_BHN, t, block=SCALE_BLOCK):
    """Per-token view ``[B, H, T]`` of block scales ``[B, H, N]``."""
    return jnp.repeat(scales_BHN, block, axis=-1)[..., :t]


def quantize_tokens(x_BHTD, precision="fp8", block=SCALE_BLOCK):
    """Quantize ``[B, H, T, D]`` with per-token-block scales: ``(x8, scales [B, H, N])``."""
    scales = token_block_scales(x_BHTD, precision, block)
    per_token = expand_token_scales(scales, x_BHTD.shape[2], block)[..., None]
    return cast_operand(x_BHTD, per_token, precision), scales
