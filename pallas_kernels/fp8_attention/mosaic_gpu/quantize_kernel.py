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
groups split as (h, t, e)): (h, t, e) -> (t, h, e). Triton blocks are powers of two, so a
head dim that is not one (MLA's 192) is cut into column pieces of the largest power of two
dividing it (3 x 64): one program per piece reads every piece of its tile for the shared
scale (the repeats come from L2) and writes its own.
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


def _kernel(*refs, pieces: int, values: bool, k_major: bool):
    # refs: the tile's ``pieces`` column blocks [128, Dp] (token, d), then (pieces > 1) the
    # block this program writes, then the outputs. Non-finite values are zeroed and their
    # tokens flagged (quantize.py).
    def finite_part(x_ref):
        raw = x_ref[...].astype(jnp.float32)
        finite = jnp.abs(raw) < jnp.inf  # False for NaN and Inf alike
        return finite, jnp.where(finite, raw, 0.0)

    parts = [finite_part(x_ref) for x_ref in refs[:pieces]]
    # the parts are finite: their amax is the finite amax
    scale = numerics.pow2_scale(
        functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for _, x in parts])
    )
    x = finite_part(refs[pieces])[1] if pieces > 1 else parts[0][1]
    # numerics.quantize without its clip and NaN code: x is finite and scale is a power of
    # two <= 448 / amax, so |x scale| <= 448 exactly (numerics.quantize_by_own_amax)
    x8 = (x * scale).astype(numerics.FP8_DTYPE)
    outs = list(refs[pieces + (pieces > 1) :])
    if values:
        outs.pop(0)[...] = x8
    if k_major:  # [8, 2, 4, 2, Dp] (group, h, t, e, d) -> [Dp, 8, 4, 2, 2] (d, group, t, h, e)
        dp = x8.shape[-1]
        grouped = x8.reshape(GROUPS, 2, 4, 2, dp)
        outs.pop(0)[...] = jnp.transpose(grouped, (4, 0, 2, 1, 3)).reshape(dp, BLOCK)
    inv = 1.0 / scale
    # every piece's program writes the same factors and flags
    outs.pop(0)[...] = jnp.full((BLOCK,), inv, jnp.float32)
    outs.pop(0)[...] = jnp.full((ROWS,), inv, jnp.float32)
    bad = [jnp.max(jnp.where(finite, 0, 1), axis=-1) for finite, _ in parts]
    outs.pop(0)[...] = functools.reduce(jnp.maximum, bad).astype(jnp.int32)


WARPS = 16  # per program: the fastest of 4, 8, 16 on the H200 (docs/mosaic_gpu.md)


def quantizer(fused: bool, interpret: bool = False, num_warps: int = WARPS):
    """The pre-pass to run: this kernel (``fused``, ``num_warps`` per program) or the XLA
    pass, bitwise the same."""
    if not fused:
        return xla_pass.quantize
    return functools.partial(quantize, interpret=interpret, num_warps=num_warps)


def column_piece(d: int) -> int:
    """The kernel's column block for head dim ``d``: the largest power of two dividing it."""
    return d & -d


def fused_supported(d: int) -> bool:
    return column_piece(d) >= 16


def quantize(
    x_BTHD,
    *,
    values: bool = True,
    k_major: bool = False,
    interpret: bool = False,
    num_warps: int = WARPS,
) -> MosaicOperand:
    """:func:`.quantize.quantize` in one kernel (head dims whose largest power-of-two
    divisor is at least 16; the XLA pass otherwise); ``num_warps`` per program changes the
    speed only."""
    b, t, h, d = x_BTHD.shape
    if not fused_supported(d):
        return xla_pass.quantize(x_BTHD, values=values, k_major=k_major)
    dp = column_piece(d)
    pieces = d // dp
    tp = xla_pass.padded_length(t)
    x = x_BTHD if tp == t else jnp.pad(x_BTHD, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    n = tp // BLOCK
    # pieces vary fastest in the launch order: a tile's programs run side by side
    grid = (pieces, n, b, h)

    def tile(piece=None):  # column block `piece`, or the program's own
        return pl.BlockSpec(
            (None, BLOCK, None, dp),
            lambda p, i, bi, hi: (bi, i, hi, p if piece is None else piece),
        )

    in_specs = [tile(c) for c in range(pieces)] + ([tile()] if pieces > 1 else [])
    out_specs, out_shape = [], []
    if values:
        out_specs.append(pl.BlockSpec((None, None, BLOCK, dp), lambda p, i, bi, hi: (bi, hi, i, p)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, tp, d), numerics.FP8_DTYPE))
    if k_major:
        out_specs.append(pl.BlockSpec((None, None, dp, BLOCK), lambda p, i, bi, hi: (bi, hi, p, i)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, d, tp), numerics.FP8_DTYPE))
    out_specs += [
        pl.BlockSpec((None, None, BLOCK), lambda p, i, bi, hi: (bi, hi, i)),
        pl.BlockSpec((None, None, None, ROWS), lambda p, i, bi, hi: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, BLOCK), lambda p, i, bi, hi: (bi, hi, i)),
    ]
    out_shape += [
        jax.ShapeDtypeStruct((b, h, tp), jnp.float32),
        jax.ShapeDtypeStruct((b, h, n, ROWS), jnp.float32),
        jax.ShapeDtypeStruct((b, h, tp), jnp.int32),  # token flags
    ]
    outs = pl.pallas_call(
        functools.partial(_kernel, pieces=pieces, values=values, k_major=k_major),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="dm_fp8_attention_quantize",
    )(*[x] * len(in_specs))
    outs = list(outs)
    vals = outs.pop(0) if values else None
    vals_t = outs.pop(0) if k_major else None
    inv_tokens, inv_rows, flags = outs
    return MosaicOperand(vals, vals_t, inv_tokens, inv_rows, flags > 0)
