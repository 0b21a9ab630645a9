"""Backward kernels: dQ (query-tile pass) and dK, dV (key-tile pass), all dots in FP8.

Both passes recompute, per (query tile i, key tile j) of bwd_block_q x bwd_block_k,
    P   = exp(S - lse),   dP^ = dO^ V^^T         (common.probs_and_dp, as the delta pass)
    dS  = P (dP^ - delta)                        (FP32)
    s   = power of two from the amax of each row of the tile along the gradient's rows
          (``ds_scale="rows"``: per query for dQ, per key for dK) or of the whole tile
          (``"tile"``: the same dS^ in both passes),  dS^ = cast(dS * s)
Then
    dQ_i  += (dS^ K^_j)      * (scale / s_i * inv_k)  (dQ pass, K from its K-major copy)
    dK_j  += (dS^^T Q^_i)    * (scale / s_j * inv_q)  (dK/dV pass, Q K-major)
    dV_j  += ((P*256)^^T dO^_i) * (inv_do / 256)      (dK/dV pass, dO K-major)
The dK/dV pass loops over every query head of the kv head's group (GQA / MQA reduction)
and, when causal, starts at the first query tile that sees key tile j.
With ``with_stats`` the dQ pass also returns the dS row statistics (sum_j dS_ij and
sum_j |dS_ij| before and after the cast) for the diagnostics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.triton import common
from pallas_kernels.fp8_attention.tiles import ds_scale_axes
from pallas_kernels.fp8_attention.triton.common import F32, MaskSpec


def _ds_tile(p, dp, delta, precision, amax_axis=None):
    """dS = P (dP^ - delta) [queries, keys] and its cast: (ds, ds8, in_scale, out_scale).

    ``amax_axis`` None: one scale per tile; 1: one per query (over the tile's keys: dQ's
    rows); 0: one per key (over its queries: dK's rows), ``tiles.DS_SCALES``' "rows".
    in_scale broadcasts against ds, out_scale against the gradient's [rows, D] tile.
    """
    ds = p * (dp - delta[:, None])
    if amax_axis is None or precision != "fp8":
        scale = numerics.tile_scale(ds, precision)
        return ds, numerics.cast_operand(ds, scale, precision), scale, scale
    vec = numerics.tile_scale(ds, precision, axis=amax_axis)
    in_scale = vec[:, None] if amax_axis == 1 else vec[None, :]
    return ds, numerics.cast_operand(ds, in_scale, precision), in_scale, vec[:, None]


def _amax_axes(ds_scale: str):
    """(dQ's, dK's) amax axis of a [queries, keys] dS tile for ``ds_scale`` (None: all):
    :func:`tiles.ds_scale_axes` in the form :func:`_ds_tile` takes."""
    return tuple(axes[0] % 2 if len(axes) == 1 else None for axes in ds_scale_axes(ds_scale))


def _dq_kernel(
    q_ref,
    inv_q_ref,
    k_ref,
    inv_k_ref,
    kt_ref,
    do_ref,
    inv_do_ref,
    v_ref,
    inv_v_ref,
    lse_ref,
    delta_ref,
    *rest,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    n_k: int,
    with_stats: bool,
    amax_axis=None,
):
    n_seg = 2 if mask.segments else 0
    q_seg_ref, kv_seg_ref = rest[:n_seg] if n_seg else (None, None)
    dq_ref, stat_refs = rest[n_seg], rest[n_seg + 1 :]
    i = pl.program_id(0)
    q8, inv_q = q_ref[...], inv_q_ref[...]
    do8, inv_do = do_ref[...], inv_do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = common.positions(i, block_q)
    q_seg = q_seg_ref[...] if mask.segments else None

    def body(j, carry, masked):
        dq, stats = carry
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        valid = None
        if masked:
            k_seg = kv_seg_ref[keys] if mask.segments else None
            valid = common.valid_mask(mask, q_pos, common.positions(j, block_k), q_seg, k_seg)
        inv_k = inv_k_ref[keys]
        p, dp = common.probs_and_dp(
            q8,
            inv_q,
            k_ref[keys, :],
            inv_k,
            do8,
            inv_do,
            v_ref[keys, :],
            inv_v_ref[keys],
            lse,
            valid,
            sm_scale,
        )
        ds, ds8, ds_scale, row_scale = _ds_tile(p, dp, delta, precision, amax_axis)
        descale = (sm_scale / row_scale) * common.tile_scalar(inv_k)
        dq = dq + common.dot_nt(ds8, kt_ref[:, keys]) * descale  # dS^ K^ (K^T K-major)
        if with_stats:
            ds_post = ds8.astype(F32) / ds_scale
            stats = (
                stats[0] + jnp.sum(ds, axis=1),
                stats[1] + jnp.sum(jnp.abs(ds), axis=1),
                stats[2] + jnp.sum(ds_post, axis=1),
                stats[3] + jnp.sum(jnp.abs(ds_post), axis=1),
            )
        return dq, stats

    zeros = jnp.zeros((block_q,), F32)
    init = (jnp.zeros(dq_ref.shape, F32), (zeros,) * 4 if with_stats else ())
    dq, stats = common.key_loop(body, init, i, block_q, block_k, n_k, mask)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    for ref, value in zip(stat_refs, stats):
        ref[...] = value


def _dkdv_kernel(
    q_ref,
    qt_ref,
    inv_q_ref,
    k_ref,
    inv_k_ref,
    v_ref,
    inv_v_ref,
    do_ref,
    dot_ref,
    inv_do_ref,
    lse_ref,
    delta_ref,
    *rest,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    n_q: int,
    group: int,
    amax_axis=None,
):
    if mask.segments:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref = rest
    else:
        (dk_ref, dv_ref), q_seg_ref, kv_seg_ref = rest, None, None
    j = pl.program_id(0)
    k8, inv_k = k_ref[...], inv_k_ref[...]
    v8, inv_v = v_ref[...], inv_v_ref[...]
    k_pos = common.positions(j, block_k)
    k_seg = kv_seg_ref[...] if mask.segments else None
    p_scale = numerics.p_scale(precision)

    def head_body(g, carry):
        def q_body(i, carry, masked):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
            inv_q, inv_do = inv_q_ref[g, rows], inv_do_ref[g, rows]
            valid = None
            if masked:
                q_seg = q_seg_ref[rows] if mask.segments else None
                valid = common.valid_mask(mask, common.positions(i, block_q), k_pos, q_seg, k_seg)
            p, dp = common.probs_and_dp(
                q_ref[g, rows, :],
                inv_q,
                k8,
                inv_k,
                do_ref[g, rows, :],
                inv_do,
                v8,
                inv_v,
                lse_ref[g, rows],
                valid,
                sm_scale,
            )
            _, ds8, _, key_scale = _ds_tile(p, dp, delta_ref[g, rows], precision, amax_axis)
            # dK_j += dS^^T Q^ (Q^T K-major), dV_j += (P*256)^^T dO^ (dO^T K-major)
            descale_k = (sm_scale / key_scale) * common.tile_scalar(inv_q)
            dk = dk + common.dot_tt(ds8, qt_ref[g, :, rows]) * descale_k
            p8 = numerics.cast_probabilities(p, precision)
            dv = dv + common.dot_tt(p8, dot_ref[g, :, rows]) * (
                common.tile_scalar(inv_do) / p_scale
            )
            return dk, dv

        return common.query_loop(q_body, carry, j, block_q, block_k, n_q, mask)

    init = (jnp.zeros(dk_ref.shape, F32), jnp.zeros(dv_ref.shape, F32))
    dk, dv = lax.fori_loop(0, group, head_body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dq_pass(
    q,
    k,
    v,
    do,
    lse,
    delta,
    q_seg=None,
    kv_seg=None,
    *,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    with_stats: bool = False,
    fp8_accumulation: str = "precise",
    ds_scale: str = "rows",
):
    """dQ [B, Hq, Tp, Dqk] f32 (and, with ``with_stats``, four [B, Hq, Tp] row statistics).

    q, do: QuantizedTensor [B, Hq, Tp, D]; k (with ``values_t``), v: [B, Hkv, Sp, D];
    lse, delta: [B, Hq, Tp] f32.
    """
    b, hq, tp, dqk, hkv, sp, dv, group = common.dims(q, k, v)
    specs = common.QueryGridSpecs(block_q, group)
    in_specs = [
        specs.q_tile(dqk),
        specs.q_rows(),
        specs.kv_whole(sp, dqk),
        specs.kv_rows(sp),
        specs.kv_whole(dqk, sp),
        specs.q_tile(dv),
        specs.q_rows(),
        specs.kv_whole(sp, dv),
        specs.kv_rows(sp),
        specs.q_rows(),
        specs.q_rows(),
    ]
    args = [
        q.values,
        q.inv_scale,
        k.values,
        k.inv_scale,
        k.values_t,
        do.values,
        do.inv_scale,
        v.values,
        v.inv_scale,
        lse,
        delta,
    ]
    if mask.segments:
        in_specs += specs.segments(sp)
        args += [q_seg, kv_seg]
    n_stats = 4 if with_stats else 0
    out_specs = [specs.q_tile(dqk)] + [specs.q_rows()] * n_stats
    out_shape = [jax.ShapeDtypeStruct((b, hq, tp, dqk), F32)]
    out_shape += [jax.ShapeDtypeStruct((b, hq, tp), F32)] * n_stats
    kernel = functools.partial(
        _dq_kernel,
        mask=mask,
        sm_scale=sm_scale,
        precision=precision,
        block_q=block_q,
        block_k=block_k,
        n_k=sp // block_k,
        with_stats=with_stats,
        amax_axis=_amax_axes(ds_scale)[0],
    )
    outs = pl.pallas_call(
        kernel,
        grid=(tp // block_q, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=common.kernel_name("dm_fp8_attention_dq", fp8_accumulation),
    )(*args)
    return outs[0], tuple(outs[1:])


def dkdv_pass(
    q,
    k,
    v,
    do,
    lse,
    delta,
    q_seg=None,
    kv_seg=None,
    *,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    fp8_accumulation: str = "precise",
    ds_scale: str = "rows",
):
    """dK [B, Hkv, Sp, Dqk], dV [B, Hkv, Sp, Dv] f32, summed over each kv head's query group.

    q, do: QuantizedTensor [B, Hq, Tp, D] with ``values_t``; k, v: [B, Hkv, Sp, D].
    """
    b, hq, tp, dqk, hkv, sp, dv, group = common.dims(q, k, v)

    def grouped(x):  # [B, Hq, ...] -> [B, Hkv, G, ...]: the group's query heads together
        return x.reshape((b, hkv, group) + x.shape[2:])

    kv_map = lambda j, bi, h: (bi, h, j, 0)  # noqa: E731
    rows_kv = lambda j, bi, h: (bi, h, j)  # noqa: E731
    whole4 = lambda j, bi, h: (bi, h, 0, 0, 0)  # noqa: E731
    whole3 = lambda j, bi, h: (bi, h, 0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, group, tp, dqk), whole4),
        pl.BlockSpec((None, None, group, dqk, tp), whole4),
        pl.BlockSpec((None, None, group, tp), whole3),
        pl.BlockSpec((None, None, block_k, dqk), kv_map),
        pl.BlockSpec((None, None, block_k), rows_kv),
        pl.BlockSpec((None, None, block_k, dv), kv_map),
        pl.BlockSpec((None, None, block_k), rows_kv),
        pl.BlockSpec((None, None, group, tp, dv), whole4),
        pl.BlockSpec((None, None, group, dv, tp), whole4),
        pl.BlockSpec((None, None, group, tp), whole3),
        pl.BlockSpec((None, None, group, tp), whole3),
        pl.BlockSpec((None, None, group, tp), whole3),
    ]
    args = [
        grouped(q.values),
        grouped(q.values_t),
        grouped(q.inv_scale),
        k.values,
        k.inv_scale,
        v.values,
        v.inv_scale,
        grouped(do.values),
        grouped(do.values_t),
        grouped(do.inv_scale),
        grouped(lse),
        grouped(delta),
    ]
    if mask.segments:
        in_specs += [
            pl.BlockSpec((None, tp), lambda j, bi, h: (bi, 0)),
            pl.BlockSpec((None, block_k), lambda j, bi, h: (bi, j)),
        ]
        args += [q_seg, kv_seg]
    kernel = functools.partial(
        _dkdv_kernel,
        mask=mask,
        sm_scale=sm_scale,
        precision=precision,
        block_q=block_q,
        block_k=block_k,
        n_q=tp // block_q,
        group=group,
        amax_axis=_amax_axes(ds_scale)[1],
    )
    return pl.pallas_call(
        kernel,
        grid=(sp // block_k, b, hkv),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_k, dqk), kv_map),
            pl.BlockSpec((None, None, block_k, dv), kv_map),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, sp, dqk), F32),
            jax.ShapeDtypeStruct((b, hkv, sp, dv), F32),
        ],
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=common.kernel_name("dm_fp8_attention_dkdv", fp8_accumulation),
    )(*args)
