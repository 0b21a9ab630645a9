"""Fused backward: dQ, dK and dV in one key-tile pass (opt-in: ``BlockSizes.fused_backward``).

The two-pass backward (:mod:`.backward`) recomputes, for every (query tile i, key tile j),
S, P, dP^ and dS^ twice: once in the dQ pass and once in the dK/dV pass (7 dots per tile
pair). This pass runs the dK/dV pass's loop (grid over key tiles j, each program looping
over the kv head's group of query heads and the query tiles that see j) and, with the same
dS^ tile and tile scale s, also adds the tile's dQ term (5 dots per tile pair):

    dQ_i += (dS^ K^_j) * (scale / s * inv_k)      (K^ from its K-major copy, as the dQ pass)

Many programs (one per key tile) add into the same dQ rows, so dQ is an f32 output that
starts at zero (a zeros input aliased to it) and every program sees the whole [Tp, Dqk] of
its (batch, query head) and adds with atomics in global memory. Each dQ term is bitwise
the dQ pass's; only the f32 summation order over key tiles differs (and, on the GPU, is
not fixed from run to run).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_attention import backward, common
from pallas_kernels.fp8_attention.common import F32, MaskSpec


def _fused_kernel(*refs, sm_scale: float, **statics):
    # refs: the dK/dV pass's inputs, K^T tile [Dqk, bk], zero dQ (aliased to dq_ref),
    # then the outputs dK, dV tiles and dQ [G, Tp, Dqk] of the (batch, kv head)
    *dkdv_refs, kt_ref, _, dk_ref, dv_ref, dq_ref = refs
    kt8, inv_k = kt_ref[...], common.tile_scalar(dkdv_refs[4][...])  # K^_j^T, its inv_k

    def add_dq(g, rows, ds8, ds_scale):
        # dQ_i += (dS^ K^_j) * (scale / s * inv_k), rows of query head h * group + g
        dq = common.dot_nt(ds8, kt8) * ((sm_scale / ds_scale) * inv_k)
        plgpu.atomic_add(dq_ref, (g, rows, slice(None)), dq)

    backward._dkdv_kernel(*dkdv_refs, dk_ref, dv_ref, sm_scale=sm_scale, add_dq=add_dq, **statics)


def fused_pass(
    q, k, v, do, lse, delta, q_seg=None, kv_seg=None, *, mask: MaskSpec, sm_scale: float,
    precision: str, block_q: int, block_k: int, num_warps: int, num_stages: int,
    interpret: bool, fp8_accumulation: str = "precise",
):
    """(dQ [B, Hq, Tp, Dqk], dK [B, Hkv, Sp, Dqk], dV [B, Hkv, Sp, Dv]) f32, padded.

    q, do: QuantizedTensor [B, Hq, Tp, D] with ``values_t``; k (with ``values_t``), v:
    [B, Hkv, Sp, D]; lse, delta: [B, Hq, Tp] f32.
    """
    b, hq, tp, dqk, hkv, sp, dv, group = common.dims(q, k, v)
    call = backward.key_grid_call(q, k, v, do, lse, delta, q_seg, kv_seg, mask=mask,
                                  sm_scale=sm_scale, precision=precision, block_q=block_q,
                                  block_k=block_k)
    # dQ as [B, Hkv, G, Tp, Dqk]: query head h * group + g, whole per (batch, kv head)
    dq_spec = pl.BlockSpec((None, None, group, tp, dqk), lambda j, bi, h: (bi, h, 0, 0, 0))
    kt_spec = pl.BlockSpec((None, None, dqk, block_k), lambda j, bi, h: (bi, h, 0, j))
    args = call.args + [k.values_t, jnp.zeros((b, hkv, group, tp, dqk), F32)]
    dk, dv, dq = pl.pallas_call(
        functools.partial(_fused_kernel, **call.statics),
        grid=call.grid,
        in_specs=call.in_specs + [kt_spec, dq_spec],
        out_specs=call.out_specs + [dq_spec],
        out_shape=call.out_shape + [jax.ShapeDtypeStruct((b, hkv, group, tp, dqk), F32)],
        input_output_aliases={len(args) - 1: 2},
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=common.kernel_name("dm_fp8_attention_fused_bwd", fp8_accumulation),
    )(*args)
    return dq.reshape(b, hq, tp, dqk), dk, dv
