"""FP8 matmuls with *current* scaling, and the linear layer built on them.

Why a small custom_vjp rather than flax's `fp8_ops` or qwix:
  * flax's `Fp8DotGeneralOp` / `Fp8Einsum` implement *delayed* scaling: scales come from an
    amax history kept as extra variables that are "overwritten by their gradient". That needs
    a special optimizer path (the history must bypass AdamW/Muon) and a variable collection
    the training code would have to route around. The paper's FP8 arms use current scaling.
  * qwix is not part of the pinned environment and its API differs between the JAX versions
    this library supports (0.10 on CPU, 0.11 on the GPU machine).
A custom_vjp with current scaling is stateless, identical on both versions, and its FP8 dots
are visible in the jaxpr (tests inspect them).

Numerics: float8_e4m3fn for activations and weights, float8_e5m2 for the output gradient
(the usual "hybrid" recipe: gradients need range more than precision; Hopper multiplies
e5m2 by e4m3), FP32 accumulation, saturating casts (clip to the format's max first),
power-of-two scales `2^floor(log2(max / amax))` (amax == 0 -> 1).

Scalings (`SCALINGS`; docs/numerics.md "FP8 linear layers"). Every scale is constant along
its dot's contraction dim, so it is applied to the FP32 result outside a plain FP8 dot:
  "per_token" (default), row-wise as in current FP8 training recipes:
      y  = x W:     one scale per token (row of x) x one per output channel (column of W)
      dx = dy W^T:  one per token (row of dy)      x one per input channel (row of W)
      dW = x^T dy:  one per input channel (column of x) x one per output channel (column of dy)
    A token's forward output depends on that token alone: the layer is causal and keeps
    sequences (and packed documents) independent. The backward sums over tokens anyway (dW),
    so its column scales may mix them. dW's x operand is the forward's FP8 x re-scaled per
    column (a power-of-two rescale of FP8 values: exact unless it falls below E4M3's normal
    range), so only FP8 activations are kept for the backward, as before.
  "per_tensor": one scale per tensor (activation, weight, output gradient), shared by all
    three matmuls; kept for comparison. Its activation scale is the amax over every token of
    the batch, so a later token (or another sequence) changes how earlier tokens round.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax import jaxpr_walk, numerics
from dm_jax.nn.matmul import (
    check_last_against_first,
    compute_dtype_dot_general,
    compute_dtype_matmul,
    dot_output_dtype,
)

FP8 = numerics.FP8_DTYPE
FP8_MAX = numerics.FP8_MAX
GRAD_FP8 = jnp.float8_e5m2  # output gradients of the linear layers (wider range)
GRAD_FP8_MAX = 57344.0
SCALINGS = ("per_token", "per_tensor")


def current_scale(x: jax.Array, fmt_max: float = FP8_MAX, axis=None) -> jax.Array:
    """Power-of-two scale s with |x * s| <= fmt_max: s = 2^floor(log2(fmt_max / amax(x))).

    The amax runs over `axis`, kept as size-1 dims so the scale broadcasts against x; with
    `axis=None` over the whole tensor, and the scale is a scalar. The rules are
    dm_jax.numerics' (amax over finite values, exact floor, amax == 0 -> 1); NaN and Inf
    propagate through the cast of the offending elements.
    """
    amax = numerics.finite_amax(x, axis=axis, keepdims=axis is not None)
    return numerics.pow2_scale(amax, fmt_max)


def quantize(x: jax.Array, scale: jax.Array, dtype=FP8) -> jax.Array:
    """Saturating cast of x * scale to an FP8 dtype (numerics.quantize)."""
    return numerics.quantize(x, scale, dtype)


class _ScaleAxes(NamedTuple):
    """The axis each operand's amax runs over, per matmul (None: the whole tensor).

    x is [M, K] (tokens x inputs), W [K, N], dy [M, N]; the reduced axis is always the
    dot's contraction dim, so each scale is constant along it.
    """

    x_fwd: int | None  # y = x W
    w_fwd: int | None
    dy_dx: int | None  # dx = dy W^T
    w_dx: int | None
    x_dw: int | None  # dW = x^T dy
    dy_dw: int | None


_AXES = {
    "per_token": _ScaleAxes(x_fwd=1, w_fwd=0, dy_dx=1, w_dx=1, x_dw=0, dy_dw=0),
    "per_tensor": _ScaleAxes(*(None,) * 6),
}


def check_scaling(scaling: str) -> str:
    if scaling not in SCALINGS:
        raise ValueError(f"scaling: must be one of {SCALINGS}, got {scaling!r}")
    return scaling


def _scaled_dot(a8, sa, b8, sb, ca: int, cb: int, out_dtype=jnp.float32) -> jax.Array:
    """Decoded result of a plain FP8 dot of 2-D operands, contracting a's axis `ca` with
    b's axis `cb`: (a8 . b8) / (s_a s_b) with each scale (size 1 along its contraction
    axis) broadcast over the result's rows (a's free axis) or columns (b's free axis), in
    ``out_dtype``. The sums are FP32; a bf16 result is written by the dot itself, and
    the power-of-two scales divide it exactly, so it holds the bits of the FP32 result
    cast to bf16 (without the FP32 tensor in memory: `dot_output_dtype`)."""
    dot_dtype = dot_output_dtype(out_dtype)
    out = jax.lax.dot_general(a8, b8, (((ca,), (cb,)), ((), ())), preferred_element_type=dot_dtype)
    scale = (sa.reshape(-1, 1) * sb.reshape(1, -1)).astype(dot_dtype)
    return (out / scale).astype(out_dtype)


def _quantized(x, axis, fmt_max=FP8_MAX, dtype=FP8):
    """(x8, scale) with one scale per slice along `axis` (None: one for the tensor)."""
    s = current_scale(x, fmt_max, axis)
    return quantize(x, s, dtype), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_matmul(
    x_MK: jax.Array, w_KN: jax.Array, scaling: str = "per_token", out_dtype=jnp.float32
) -> jax.Array:
    """y_MN = x_MK @ w_KN with both operands in FP8 (current scales, `scaling`), FP32 sums,
    in ``out_dtype`` (float32 by default; bf16 has the bits of the float32 result cast)."""
    y, _ = _fp8_matmul_fwd(x_MK, w_KN, scaling, out_dtype)
    return y


def _fp8_matmul_fwd(x_MK, w_KN, scaling, out_dtype):
    ax = _AXES[check_scaling(scaling)]
    (x8, sx), (w8, sw) = _quantized(x_MK, ax.x_fwd), _quantized(w_KN, ax.w_fwd)
    y = _scaled_dot(x8, sx, w8, sw, 1, 0, out_dtype)  # y = (x^ W^) / (s_x s_w), FP32 sums
    # w itself is a parameter (held anyway): the backward re-quantizes it when dx needs
    # other scales. x_like carries x's dtype as an array.
    return y, (x8, sx, w8, sw, w_KN, jnp.zeros((0,), x_MK.dtype))


def _fp8_matmul_bwd(scaling, out_dtype, res, dy_MN):
    del out_dtype  # dy comes in y's dtype; its FP8 casts do not depend on it
    x8, sx, w8, sw, w_KN, x_like = res
    ax = _AXES[scaling]
    g8, sg = _quantized(dy_MN, ax.dy_dx, GRAD_FP8_MAX, GRAD_FP8)
    if ax.w_dx != ax.w_fwd:
        w8, sw = _quantized(w_KN, ax.w_dx)
    dx = _scaled_dot(g8, sg, w8, sw, 1, 1, x_like.dtype)  # dx = dy^ W^^T, in x's dtype
    if ax.dy_dw != ax.dy_dx:
        g8, sg = _quantized(dy_MN, ax.dy_dw, GRAD_FP8_MAX, GRAD_FP8)
    if ax.x_dw != ax.x_fwd:
        x8, sx = _quantized(numerics.dequantize(x8, sx), ax.x_dw)
    dw = _scaled_dot(x8, sx, g8, sg, 0, 0)  # dW = x^^T dy^
    return dx, dw.astype(w_KN.dtype)


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def dot_operand_dtypes(closed_jaxpr) -> list[tuple]:
    """The operand dtypes of every dot_general equation in a jaxpr, sub-jaxprs (custom_vjp
    bodies, scans, conds) included, in the order the walk meets them."""
    return [
        tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars)
        for eqn in jaxpr_walk.equations(closed_jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


def fp8_dot_count(closed_jaxpr) -> int:
    """Number of dot_general equations with an FP8 operand in a jaxpr (sub-jaxprs included).

    `fp8_dot_count(jax.make_jaxpr(fn)(*args))` checks which matmuls a precision scope puts
    in FP8.
    """
    return sum(
        any(d.itemsize == 1 and "float8" in str(d) for d in dtypes)
        for dtypes in dot_operand_dtypes(closed_jaxpr)
    )


def fp8_dot_general(
    x_XK,
    w_KN,
    dimension_numbers=None,
    precision=None,
    preferred_element_type=None,
    *,
    scaling: str = "per_token",
    out_dtype=jnp.float32,
    **kwargs,
) -> jax.Array:
    """`jax.lax.dot_general` as `nnx.Linear` calls it (x's last dim against w's first), with
    both operands in FP8 (`fp8_matmul` with `scaling`); returns [..., N] in ``out_dtype``
    (float32 by default), FP32 accumulation always."""
    del precision, preferred_element_type, kwargs
    check_last_against_first(x_XK, dimension_numbers, "the FP8 dot")
    y_MN = fp8_matmul(x_XK.reshape(-1, x_XK.shape[-1]), w_KN, scaling, out_dtype)
    return y_MN.reshape(*x_XK.shape[:-1], w_KN.shape[-1])


def _cast_input_only(args, *, dtype=None, inexact=True):
    """`promote_dtype` for the FP8 path: the input goes to `dtype`, the FP32 kernel (and bias)
    stay as stored, so the weights are quantized from FP32 and not rounded to bf16 first."""
    del inexact
    x, *rest = args
    return (x if dtype is None else jnp.asarray(x, dtype), *rest)


class Linear(nnx.Linear):
    """`nnx.Linear` (y = x @ W (+ b), weights stored in float32) whose output is in
    `out_dtype` (default `dtype`, bf16 by default), with the matmul in FP8 (current
    scaling, `fp8_dot_general`) when `fp8=True`, otherwise in `dtype` with FP32
    accumulation (the backward's dots too, dW summed in FP32: `compute_dtype_matmul`).
    `fp8_scaling` picks the FP8 scale granularity (`SCALINGS`: "per_token" keeps every
    token's output its own). Without a bias the dot writes y in `out_dtype` itself.

    The kernel is initialized N(0, init_std^2), init_std defaulting to in_features^-1/2.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        fp8: bool = False,
        fp8_scaling: str = "per_token",
        use_bias: bool = False,
        dtype=jnp.bfloat16,
        out_dtype=None,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features/out_features must be positive, got {in_features}/{out_features}"
            )
        std = init_std if init_std is not None else in_features**-0.5
        # the kernel stays FP32 into either dot, which casts it itself: FP8 from FP32, or
        # bf16 with the backward's dots in bf16 and dW's sums kept in FP32 (nn/matmul.py).
        # Without a bias the dot writes y in `out_dtype` itself (the bits of its FP32
        # result cast, without that FP32 tensor in memory); a bias is added to the FP32
        # result.
        out_dtype = jnp.dtype(dtype if out_dtype is None else out_dtype)
        dot_out = jnp.float32 if use_bias else out_dtype
        dot = functools.partial(compute_dtype_dot_general, out_dtype=dot_out)
        if fp8:
            dot = functools.partial(
                fp8_dot_general, scaling=check_scaling(fp8_scaling), out_dtype=dot_out
            )
        extra = dict(dot_general=dot, promote_dtype=_cast_input_only)
        super().__init__(
            in_features,
            out_features,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=jax.nn.initializers.normal(std),
            preferred_element_type=jnp.float32,
            rngs=rngs,
            **extra,
        )
        self.fp8, self.fp8_scaling, self.out_dtype = fp8, fp8_scaling, out_dtype

    def __call__(self, x_XK: jax.Array) -> jax.Array:
        """x_XK [..., in_features] -> [..., out_features] in `out_dtype`."""
        if x_XK.shape[-1] != self.in_features:
            raise ValueError(f"x: expected last dim {self.in_features}, got shape {x_XK.shape}")
        return super().__call__(x_XK).astype(self.out_dtype)


def fused_linear(x_XK: jax.Array, linears) -> list[jax.Array]:
    """[lin(x_XK) for lin in linears] as one matmul of x with the layers' kernels side by
    side: one read of x and one GEMM forward (two backward) instead of one per layer. Each
    output column is the dot product its own layer forms, so the results agree with the
    separate calls up to the accumulation order of the f32 sums. The layers must be
    high-precision (not FP8) `Linear`s without bias of the same input width, dtype and
    precision; the parameters stay where they are (checkpoints do not change)."""
    first = linears[0]
    for lin in linears:
        same = (lin.in_features, lin.dtype, lin.precision) == (
            first.in_features,
            first.dtype,
            first.precision,
        )
        if lin.fp8 or lin.bias is not None or not same:
            raise ValueError(
                "linears: fused_linear takes non-FP8 Linear layers without bias of one input "
                f"width, dtype and precision; got in_features {lin.in_features}, dtype "
                f"{lin.dtype}, fp8 {lin.fp8}, bias {lin.bias is not None}"
            )
    if x_XK.shape[-1] != first.in_features:
        raise ValueError(f"x: expected last dim {first.in_features}, got shape {x_XK.shape}")
    kernel = jnp.concatenate([lin.kernel[...] for lin in linears], axis=1)  # FP32
    x = x_XK.astype(first.dtype)
    y = compute_dtype_matmul(x, kernel, first.dtype, first.precision, first.dtype)
    return split_widths(y, [lin.out_features for lin in linears])


def split_widths(x, widths) -> list[jax.Array]:
    """x's last axis cut into consecutive parts of ``widths`` (which sum to its size)."""
    return jnp.split(x, list(itertools.accumulate(widths))[:-1], axis=-1)


class RMSNorm(nnx.RMSNorm):
    """`nnx.RMSNorm` (learned per-channel gains `scale`, init 1; statistics in FP32) whose
    output keeps the input's dtype.

    The gains need no random key: `rngs` may be left out, and none is drawn from the model's
    streams, so adding a norm leaves the initialization of every other layer unchanged.
    """

    def __init__(
        self,
        features: int,
        *,
        eps: float = 1e-6,
        use_scale: bool = True,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        super().__init__(
            features, epsilon=eps, use_scale=use_scale, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
        )

    def __call__(self, x_XD: jax.Array) -> jax.Array:
        return super().__call__(x_XD).astype(x_XD.dtype)
