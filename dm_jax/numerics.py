"""FP8 formats and scale rules (re-exported from :mod:`pallas_kernels.fp8_attention.numerics`).

The rules live beside the kernels that implement them, so that ``pallas_kernels`` never
imports ``dm_jax``; this module keeps ``from dm_jax import numerics`` working for the
library, the reference and the tests.
"""

from pallas_kernels.fp8_attention.numerics import (  # noqa: F401
    DELTA_MODES,
    FP8_DTYPE,
    FP8_MAX,
    P_SCALE,
    PRECISIONS,
    SCALE_BLOCK,
    cast_operand,
    cast_probabilities,
    dequantize,
    expand_token_scales,
    finite_amax,
    finite_or_zero,
    fixed_order_sum,
    nonfinite_tokens,
    operand_dtype,
    p_scale,
    poison,
    pow2_scale,
    quantize,
    quantize_tokens,
    row_dot,
    tile_scale,
    token_block_scales,
    upcast,
)
