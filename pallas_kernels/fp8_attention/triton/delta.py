"""The softmax-backward correction delta_i, three ways.

  * ``stale``:      delta_i = sum_d dO_id O_id     (dO before its cast; what other kernels do)
  * ``do_matched``: delta_i = sum_d dO^_id O_id    (the decoded FP8 dO the backward uses)
  * ``matched``:    delta_i = sum_j P_ij dP^_ij    (P recomputed in FP32, dP^ the FP32 result
    of the FP8 dot dO^ V^^T), a Pallas pre-pass over all key tiles.

The matched pass forms P and dP^ through :func:`common.probs_and_dp`, the function the dQ
and dK/dV passes use, with the backward tiles (bwd_block_q x bwd_block_k), the same scales
and the same dot orientation, so delta_i cancels the row sums of dS = P (dP^ - delta)
up to FP32 rounding. The two row dots are XLA reductions (one fused elementwise pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.triton import common
from pallas_kernels.fp8_attention.triton.common import F32, MaskSpec


def row_dot_delta(mode: str, do_BTHD, o_BTHD, do8, tp: int):
    """stale / do_matched delta, padded to [B, H, Tp] (0 on padding rows).

    ``do8`` is the QuantizedTensor of dO (used by ``do_matched``).
    """
    o = jnp.swapaxes(o_BTHD, 1, 2).astype(F32)  # [B, H, T, Dv]
    t, dv = o.shape[2], o.shape[3]
    if mode == "stale":
        do = jnp.swapaxes(do_BTHD, 1, 2).astype(F32)
    elif mode == "do_matched":
        # upcast, not astype: XLA on the GPU would drop the f32 -> e4m3 -> f32 round trip
        do = numerics.upcast(do8.values[:, :, :t, :dv]) * do8.inv_scale[:, :, :t, None]
    else:
        raise ValueError(f"row_dot_delta: mode must be 'stale' or 'do_matched', got {mode!r}")
    rows = numerics.row_dot(do, o)  # the emulation sums in the same fixed order
    return jnp.pad(rows, ((0, 0), (0, 0), (0, tp - t)))


def _matched_delta_kernel(
    q_ref,
    inv_q_ref,
    k_ref,
    inv_k_ref,
    do_ref,
    inv_do_ref,
    v_ref,
    inv_v_ref,
    lse_ref,
    *rest,
    mask: MaskSpec,
    sm_scale: float,
    block_q: int,
    block_k: int,
    n_k: int,
    fixed_order: bool,
):
    if mask.segments:
        q_seg_ref, kv_seg_ref, delta_ref = rest
    else:
        (delta_ref,), q_seg_ref, kv_seg_ref = rest, None, None
    i = pl.program_id(0)
    q8, inv_q = q_ref[...], inv_q_ref[...]
    do8, inv_do = do_ref[...], inv_do_ref[...]
    lse = lse_ref[...]
    q_pos = common.positions(i, block_q)
    q_seg = q_seg_ref[...] if mask.segments else None

    def body(j, acc, masked):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        valid = None
        if masked:
            k_seg = kv_seg_ref[keys] if mask.segments else None
            valid = common.valid_mask(mask, q_pos, common.positions(j, block_k), q_seg, k_seg)
        p, dp = common.probs_and_dp(
            q8,
            inv_q,
            k_ref[keys, :],
            inv_k_ref[keys],
            do8,
            inv_do,
            v_ref[keys, :],
            inv_v_ref[keys],
            lse,
            valid,
            sm_scale,
        )
        # delta_i += sum_j P_ij dP^_ij. The CPU twin sums in the emulation's fixed order
        # (bitwise the same delta); the GPU uses the hardware's row reduction.
        return acc + (numerics.row_dot(p, dp) if fixed_order else jnp.sum(p * dp, axis=1))

    init = jnp.zeros((block_q,), F32)
    delta_ref[...] = common.key_loop(body, init, i, block_q, block_k, n_k, mask)


def matched_delta(
    q,
    k,
    v,
    do,
    lse,
    q_seg=None,
    kv_seg=None,
    *,
    mask: MaskSpec,
    sm_scale: float,
    block_q: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    fp8_accumulation: str = "precise",
):
    """delta_i = sum_j P_ij dP^_ij: [B, Hq, Tp] f32.

    q, do: QuantizedTensor [B, Hq, Tp, D]; k, v: [B, Hkv, Sp, D]; lse [B, Hq, Tp].
    Tiles must be the backward's (bwd_block_q, bwd_block_k).
    """
    b, hq, tp, dqk, hkv, sp, dv, group = common.dims(q, k, v)
    specs = common.QueryGridSpecs(block_q, group)
    in_specs = [
        specs.q_tile(dqk),
        specs.q_rows(),
        specs.kv_whole(sp, dqk),
        specs.kv_rows(sp),
        specs.q_tile(dv),
        specs.q_rows(),
        specs.kv_whole(sp, dv),
        specs.kv_rows(sp),
        specs.q_rows(),
    ]
    args = [
        q.values,
        q.inv_scale,
        k.values,
        k.inv_scale,
        do.values,
        do.inv_scale,
        v.values,
        v.inv_scale,
        lse,
    ]
    if mask.segments:
        in_specs += specs.segments(sp)
        args += [q_seg, kv_seg]
    kernel = functools.partial(
        _matched_delta_kernel,
        mask=mask,
        sm_scale=sm_scale,
        block_q=block_q,
        block_k=block_k,
        n_k=sp // block_k,
        fixed_order=interpret,
    )
    return pl.pallas_call(
        kernel,
        grid=(tp // block_q, b, hq),
        in_specs=in_specs,
        out_specs=specs.q_rows(),
        out_shape=jax.ShapeDtypeStruct((b, hq, tp), F32),
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=common.kernel_name("dm_fp8_attention_matched_delta", fp8_accumulation),
    )(*args)
