"""FP8 matmuls with per-tensor *current* scaling, and the linear layer built on them.

Why a small custom_vjp rather than flax's `fp8_ops` or qwix:
  * flax's `Fp8DotGeneralOp` / `Fp8Einsum` implement *delayed* scaling: scales come from an
    amax history kept as extra variables that are "overwritten by their gradient". That needs
    a special optimizer path (the history must bypass AdamW/Muon) and a variable collection
    the training code would have to route around. The paper's FP8 arms use current scaling.
  * qwix is not part of the pinned environment and its API differs between the JAX versions
    this library supports (0.10 on CPU, 0.11 on the GPU machine).
A 60-line custom_vjp with current scaling is stateless, identical on both versions, and its
FP8 dots are visible in the jaxpr (tests inspect them).

Numerics: float8_e4m3fn for activations and weights, float8_e5m2 for the output gradient
(the usual "hybrid" recipe: gradients need range more than precision; Hopper multiplies
e5m2 by e4m3), FP32 accumulation, saturating casts (clip to the format's max first),
power-of-two scales `2^floor(log2(max / amax))` (amax == 0 -> 1).
One scale per tensor (the whole activation, weight or output gradient): a per-tensor scale is
constant along every contraction dimension, so all three matmuls of a linear layer
(y = x W, dx = dy W^T, dW = x^T dy) can run on the FP8 operands directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax import numerics

FP8 = numerics.FP8_DTYPE
FP8_MAX = numerics.FP8_MAX
GRAD_FP8 = jnp.float8_e5m2  # output gradients of the linear layers (wider range)
GRAD_FP8_MAX = 57344.0


def current_scale(x: jax.Array, fmt_max: float = FP8_MAX) -> jax.Array:
    """Power-of-two scale s with |x * s| <= fmt_max: s = 2^floor(log2(fmt_max / amax(x))).

    The rules are dm_jax.numerics' (amax over finite values, exact floor, amax == 0 -> 1);
    NaN and Inf propagate through the cast of the offending elements.
    """
    return numerics.pow2_scale(numerics.finite_amax(x), fmt_max)


def quantize(x: jax.Array, scale: jax.Array, dtype=FP8) -> jax.Array:
    """Saturating cast of x * scale to an FP8 dtype (numerics.quantize)."""
    return numerics.quantize(x, scale, dtype)


def _dot(a, b, contract):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def fp8_matmul(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """y_MN (float32) = x_MK @ w_KN with both operands in FP8 (current per-tensor scales)."""
    y, _ = _fp8_matmul_fwd(x_MK, w_KN)
    return y


def _fp8_matmul_fwd(x_MK, w_KN):
    sx, sw = current_scale(x_MK), current_scale(w_KN)
    x8, w8 = quantize(x_MK, sx), quantize(w_KN, sw)
    y = _dot(x8, w8, ((1,), (0,))) / (sx * sw)  # y = (x^ W^) / (s_x s_w), FP32 accumulate
    like = (jnp.zeros((0,), x_MK.dtype), jnp.zeros((0,), w_KN.dtype))  # dtypes, as arrays
    return y, (x8, w8, sx, sw, like)


def _fp8_matmul_bwd(res, dy_MN):
    x8, w8, sx, sw, (x_like, w_like) = res
    sg = current_scale(dy_MN, GRAD_FP8_MAX)
    g8 = quantize(dy_MN, sg, GRAD_FP8)
    dx = _dot(g8, w8, ((1,), (1,))) / (sg * sw)  # dx = dy^ W^^T
    dw = _dot(x8, g8, ((0,), (0,))) / (sx * sg)  # dW = x^^T dy^
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_dot_count(closed_jaxpr) -> int:
    """Number of dot_general equations with an FP8 operand in a jaxpr (sub-jaxprs included).

    `fp8_dot_count(jax.make_jaxpr(fn)(*args))` checks which matmuls a precision scope puts
    in FP8.
    """

    def walk(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and any(
                jnp.dtype(v.aval.dtype).itemsize == 1 and "float8" in str(v.aval.dtype)
                for v in eqn.invars
            ):
                n += 1
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(inner, "eqns"):
                        n += walk(inner)
        return n

    return walk(closed_jaxpr.jaxpr)


def fp8_dot_general(
    x_XK, w_KN, dimension_numbers=None, precision=None, preferred_element_type=None, **kwargs
) -> jax.Array:
    """`jax.lax.dot_general` as `nnx.Linear` calls it (x's last dim against w's first), with
    both operands in FP8 (`fp8_matmul`); returns float32 [..., N]."""
    del precision, preferred_element_type, kwargs  # FP32 accumulation, always
    if dimension_numbers is not None and dimension_numbers != (((x_XK.ndim - 1,), (0,)), ((), ())):
        raise ValueError(
            f"dimension_numbers: the FP8 dot contracts x's last dim with w's first, "
            f"got {dimension_numbers}"
        )
    y_MN = fp8_matmul(x_XK.reshape(-1, x_XK.shape[-1]), w_KN)
    return y_MN.reshape(*x_XK.shape[:-1], w_KN.shape[-1])


def _cast_input_only(args, *, dtype=None, inexact=True):
    """`promote_dtype` for the FP8 path: the input goes to `dtype`, the FP32 kernel (and bias)
    stay as stored, so the weights are quantized from FP32 and not rounded to bf16 first."""
    del inexact
    x, *rest = args
    return (x if dtype is None else jnp.asarray(x, dtype), *rest)


class Linear(nnx.Linear):
    """`nnx.Linear` (y = x @ W (+ b), weights stored in float32) whose output is in `dtype`
    (bf16 by default), with the matmul in FP8 (current scaling, `fp8_dot_general`) when
    `fp8=True`, otherwise in `dtype` with FP32 accumulation.

    The kernel is initialized N(0, init_std^2), init_std defaulting to in_features^-1/2.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        fp8: bool = False,
        use_bias: bool = False,
        dtype=jnp.bfloat16,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features/out_features must be positive, got {in_features}/{out_features}"
            )
        std = init_std if init_std is not None else in_features**-0.5
        extra = dict(dot_general=fp8_dot_general, promote_dtype=_cast_input_only) if fp8 else {}
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
        self.fp8 = fp8

    def __call__(self, x_XK: jax.Array) -> jax.Array:
        """x_XK [..., in_features] -> [..., out_features] in `dtype`."""
        if x_XK.shape[-1] != self.in_features:
            raise ValueError(f"x: expected last dim {self.in_features}, got shape {x_XK.shape}")
        return super().__call__(x_XK).astype(self.dtype)


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
