"""The Mosaic backend's quantize pre-pass as one Pallas kernel (Triton lowering).

XLA runs the pre-pass of :mod:`.quantize` as separate reductions and transposing copies:
0.2-0.29 ms for Q, K, V at [4, 4096, 16, 128] on the H200 against a bandwidth floor of
about 0.06 ms (docs/mosaic_gpu.md). Here one program per (128-token block, batch, head)
reads its [128, D] tile of ``x`` [B, T, H, D] once, takes the amax in registers and
writes every layout the kernels read: ``values`` [B, H, Tp, D], the permuted K-major
``values_t`` [B, H, D, Tp] (tokens in the FP8 register regroup's order, :mod:`.regroup`)
and the decode factors. Bitwise the same operands as :func:`.quantize.quantize`.

The tile is read and ``values`` written as plain [128, D] rows (16-byte accesses); the
regroup's token order is one transpose of the cast tile seen as [8, 2, 4, 2, D] (16-token
groups split as (h, t, e)): (h, t, e) -> (t, h, e). Head dims must be powers of two
(Triton blocks); :func:`quantize` falls back to the XLA pass otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.mosaic_gpu import quantize as xla_pass
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import BLOCK, ROWS, MosaicOperand

GROUPS = BLOCK // 16  # 16-token groups per scale block


def _kernel(x_ref, *out_refs, values: bool, k_major: bool):
    # [128, D] (token, d); non-finite values zeroed and their tokens flagged (quantize.py)
    raw = x_ref[...].astype(jnp.float32)
    finite = jnp.abs(raw) < jnp.inf  # False for NaN and Inf alike
    x = jnp.where(finite, raw, 0.0)
    scale = numerics.pow2_scale(jnp.max(jnp.abs(x)))  # x is finite: its amax is the finite amax
    # numerics.quantize without its clip and NaN code: x is finite and scale is a power of
    # two <= 448 / amax, so |x scale| <= 448 exactly (numerics.quantize_by_own_amax)
    x8 = (x * scale).astype(numerics.FP8_DTYPE)
    refs = list(out_refs)
    if values:
        refs.pop(0)[...] = x8
    if k_major:  # [8, 2, 4, 2, D] (group, h, t, e, d) -> [D, 8, 4, 2, 2] (d, group, t, h, e)
        d = x8.shape[-1]
        grouped = x8.reshape(GROUPS, 2, 4, 2, d)
        refs.pop(0)[...] = jnp.transpose(grouped, (4, 0, 2, 1, 3)).reshape(d, BLOCK)
    inv = 1.0 / scale
    refs.pop(0)[...] = jnp.full((BLOCK,), inv, jnp.float32)
    refs.pop(0)[...] = jnp.full((ROWS,), inv, jnp.float32)
    refs.pop(0)[...] = jnp.max(jnp.where(finite, 0, 1), axis=-1).astype(jnp.int32)


WARPS = 16  # per program: the fastest of 4, 8, 16 on the H200 (docs/mosaic_gpu.md)


def quantizer(fused: bool, interpret: bool = False, num_warps: int = WARPS):
    """The pre-pass to run: this kernel (``fused``, ``num_warps`` per program) or the XLA
    pass, bitwise the same."""
    if not fused:
        return xla_pass.quantize
    return functools.partial(quantize, interpret=interpret, num_warps=num_warps)


def fused_supported(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def quantize(
    x_BTHD,
    *,
    values: bool = True,
    k_major: bool = False,
    interpret: bool = False,
    num_warps: int = WARPS,
) -> MosaicOperand:
    """:func:`.quantize.quantize` in one kernel (head dims that are powers of two);
    ``num_warps`` per program changes the speed only."""
    b, t, h, d = x_BTHD.shape
    if not fused_supported(d):
        return xla_pass.quantize(x_BTHD, values=values, k_major=k_major)
    tp = xla_pass.padded_length(t)
    x = x_BTHD if tp == t else jnp.pad(x_BTHD, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    n = tp // BLOCK
    grid = (n, b, h)
    in_spec = pl.BlockSpec((None, BLOCK, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    out_specs, out_shape = [], []
    if values:
        out_specs.append(pl.BlockSpec((None, None, BLOCK, d), lambda i, bi, hi: (bi, hi, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, tp, d), numerics.FP8_DTYPE))
    if k_major:
        out_specs.append(pl.BlockSpec((None, None, d, BLOCK), lambda i, bi, hi: (bi, hi, 0, i)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, d, tp), numerics.FP8_DTYPE))
    out_specs += [
        pl.BlockSpec((None, None, BLOCK), lambda i, bi, hi: (bi, hi, i)),
        pl.BlockSpec((None, None, None, ROWS), lambda i, bi, hi: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, BLOCK), lambda i, bi, hi: (bi, hi, i)),
    ]
    out_shape += [
        jax.ShapeDtypeStruct((b, h, tp), jnp.float32),
        jax.ShapeDtypeStruct((b, h, n, ROWS), jnp.float32),
        jax.ShapeDtypeStruct((b, h, tp), jnp.int32),  # token flags
    ]
    outs = pl.pallas_call(
        functools.partial(_kernel, values=values, k_major=k_major),
        grid=grid,
        in_specs=[in_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="dm_fp8_attention_quantize",
    )(x)
    outs = list(outs)
    vals = outs.pop(0) if values else None
    vals_t = outs.pop(0) if k_major else None
    inv_tokens, inv_rows, flags = outs
    return MosaicOperand(vals, vals_t, inv_tokens, inv_rows, flags > 0)
