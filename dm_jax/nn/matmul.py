"""High-precision linear layers' matmul: bf16 operands in all three dots, FP32 sums.

    y  = x W      x, W in the compute dtype (bf16), FP32 accumulation; FP32 output, or
                  the layer's own dtype written by the dot itself (``out_dtype``)
    dx = dy W^T   dy cast to the compute dtype; FP32 accumulation, dx in x's dtype
    dW = x^T dy   the same operands; FP32 accumulation, dW in the stored kernel's FP32

Plain autodiff of `dot_general(x_bf16, W_bf16, preferred_element_type=f32)` transposes
with the FP32 cotangent: dx and dW become FP32 x FP32 matmuls (TF32 at best on the GPU,
half the bf16 rate, twice the bytes), and dW is still rounded to bf16 at the kernel's
cast. Here the cotangent is cast once, both gradient dots run at the bf16 rate, and dW
keeps its FP32 sums (docs/training.md, "The step profile at 4 x 4096 on an H100, and the
bf16 layers' backward dots"; docs/models.md).

A 16-bit result (y in ``out_dtype``, dx in x's dtype) comes out of the dot itself, rounded
once from its FP32 sums: the same bits as an FP32 result cast afterwards, without writing
and reading the FP32 tensor in between (docs/training.md, "16-bit results straight from
the dots").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# result dtypes a dot writes itself from its FP32 sums (one rounding, as a cast after an
# FP32 result): FP32's exponent range, so no product overflows them. Others (f16) are
# cast after an FP32 result.
DOT_OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def dot_output_dtype(dtype) -> jnp.dtype:
    """The dtype a dot with FP32 sums writes for a result wanted in ``dtype`` (None: FP32)."""
    dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    return dtype if dtype in DOT_OUTPUT_DTYPES else jnp.dtype(jnp.float32)


def _contract_last_first(x, w, precision, dtype=None):
    """x [..., K] @ w [K, N] with FP32 accumulation; the result in FP32 or ``dtype``
    (bf16 written by the dot itself: :func:`dot_output_dtype`)."""
    y = jax.lax.dot_general(
        x,
        w,
        (((x.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=dot_output_dtype(dtype),
    )
    return y if dtype is None else y.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def compute_dtype_matmul(x_XK, w_KN, dtype, precision=None, out_dtype=None):
    """x_XK [..., K] @ w_KN [K, N] with both operands in ``dtype`` -> [..., N] in
    ``out_dtype`` (None: float32), rounded once from the FP32 sums."""
    return _contract_last_first(x_XK.astype(dtype), w_KN.astype(dtype), precision, out_dtype)


def _forward(x_XK, w_KN, dtype, precision, out_dtype):
    return compute_dtype_matmul(x_XK, w_KN, dtype, precision, out_dtype), (x_XK, w_KN)


def _backward(dtype, precision, out_dtype, residuals, dy_XN):
    del out_dtype  # dy comes in y's dtype and is cast to the compute dtype either way
    x_XK, w_KN = residuals  # as given: the casts below are the forward's (XLA shares them)
    x_c, w_c = x_XK.astype(dtype), w_KN.astype(dtype)
    dy = dy_XN.astype(dtype)  # one cast: both gradient dots take compute-dtype operands
    dx = _contract_last_first(dy, w_c.T, precision, x_XK.dtype)  # dx = dy W^T
    x_MK, dy_MN = x_c.reshape(-1, x_c.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = _contract_last_first(x_MK.T, dy_MN, precision, w_KN.dtype)  # dW = x^T dy, FP32
    return dx, dw


compute_dtype_matmul.defvjp(_forward, _backward)


def check_last_against_first(x_XK, dimension_numbers, what: str) -> None:
    """Refuse ``dimension_numbers`` other than the ones `nnx.Linear` passes (x's last dim
    against the kernel's first, no batch dims); ``what`` names the dot in the error."""
    if dimension_numbers is not None and dimension_numbers != (((x_XK.ndim - 1,), (0,)), ((), ())):
        raise ValueError(
            f"dimension_numbers: {what} contracts x's last dim with w's first, "
            f"got {dimension_numbers}"
        )


def compute_dtype_dot_general(
    x_XK,
    w_KN,
    dimension_numbers=None,
    precision=None,
    preferred_element_type=None,
    *,
    out_dtype=None,
    **kwargs,
):
    """`jax.lax.dot_general` as `nnx.Linear` calls it (x's last dim against the FP32 kernel's
    first), the operands in x's dtype (`compute_dtype_matmul`); returns [..., N] in
    ``out_dtype`` (None: float32), FP32 accumulation always."""
    del preferred_element_type, kwargs
    check_last_against_first(x_XK, dimension_numbers, "the matmul")
    return compute_dtype_matmul(x_XK, w_KN, x_XK.dtype, precision, out_dtype)
