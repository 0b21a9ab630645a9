"""Entry points on the public layout ([B, T, H, D]): quantize, run the kernels, unpad.

No autodiff here: :mod:`dm_jax.attention` wraps :func:`forward` and :func:`backward` in a
``jax.custom_vjp``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention.triton import backward as bwd_kernels
from pallas_kernels.fp8_attention.triton import delta as delta_kernels
from pallas_kernels.fp8_attention.triton import forward as fwd_kernels
from pallas_kernels.fp8_attention.triton.common import MaskSpec
from pallas_kernels.fp8_attention.triton.config import BlockSizes
from pallas_kernels.fp8_attention.triton.quantize import (
    pad_rows, pad_segment_ids, padded_length, quantize,
)

MAX_HEAD_DIM = 256


class Gradients(NamedTuple):
    dq: jax.Array  # [B, T, Hq, Dqk]
    dk: jax.Array  # [B, S, Hkv, Dqk]
    dv: jax.Array  # [B, S, Hkv, Dv]
    delta: jax.Array  # [B, Hq, T]
    # sum_j dS_ij, sum_j |dS_ij| before / after the cast ([B, Hq, T]); None unless asked
    stats: Optional[tuple]


def unsupported_reason(q_shape, k_shape, v_shape, dtype, block_sizes: BlockSizes):
    """None if the kernels run this call, else a sentence saying what is supported."""
    dqk, dv = q_shape[-1], v_shape[-1]
    for name, d in (("Dqk", dqk), ("Dv", dv)):
        if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
            return (f"{name}={d}: the Pallas kernels support head dims that are multiples of "
                    f"16 up to {MAX_HEAD_DIM} (tested: 64, 128, 256 and Dqk=192 with Dv=128)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                jnp.dtype(jnp.float16)):
        return f"dtype {dtype}: the Pallas kernels take float32, bfloat16 or float16 inputs"
    if max(dqk, dv) > 128 and max(block_sizes.block_q, block_sizes.block_k) > 64:
        return ("head dims above 128 need forward tiles of at most 64 tokens "
                "(register pressure); use the default block sizes")
    return None


def _mask(q, k, q_ids, causal):
    t, s = q.shape[1], k.shape[1]
    return MaskSpec(t=t, s=s, causal=causal, segments=q_ids is not None,
                    padded=(t, s) != (padded_length(t), padded_length(s)))


def _segments(q_ids, kv_ids, tp, sp):
    return pad_segment_ids(q_ids, tp, -1), pad_segment_ids(kv_ids, sp, -2)


def forward(q, k, v, q_ids=None, kv_ids=None, *, causal: bool, sm_scale: float,
            precision: str, block_sizes: BlockSizes, interpret: bool):
    """Flash forward: (out [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] f32)."""
    t, dv = q.shape[1], v.shape[3]
    q8 = quantize(q, precision)
    k8 = quantize(k, precision)
    v8 = quantize(v, precision, k_major=True)
    q_seg, kv_seg = _segments(q_ids, kv_ids, q8.values.shape[2], k8.values.shape[2])
    bs = block_sizes
    o, lse = fwd_kernels.forward(
        q8, k8, v8, q_seg, kv_seg, mask=_mask(q, k, q_ids, causal), sm_scale=sm_scale,
        precision=precision, block_q=bs.block_q, block_k=bs.block_k,
        num_warps=bs.num_warps, num_stages=bs.num_stages, out_dtype=q.dtype,
        interpret=interpret, fp8_accumulation=bs.fp8_accumulation,
    )
    return jnp.swapaxes(o[:, :, :t, :dv], 1, 2), lse[:, :, :t]


def backward(q, k, v, o, lse, do, q_ids=None, kv_ids=None, *, causal: bool, sm_scale: float,
             precision: str, delta: str, block_sizes: BlockSizes, interpret: bool,
             with_stats: bool = False) -> Gradients:
    """Flash backward with recomputed P; see :mod:`.backward` for the equations."""
    t, s = q.shape[1], k.shape[1]
    dqk, dv_dim = q.shape[3], v.shape[3]
    q8 = quantize(q, precision, k_major=True)
    k8 = quantize(k, precision, k_major=True)
    v8 = quantize(v, precision)
    do8 = quantize(do, precision, k_major=True)
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    q_seg, kv_seg = _segments(q_ids, kv_ids, tp, sp)
    mask = _mask(q, k, q_ids, causal)
    bs = block_sizes
    common_args = dict(
        mask=mask, sm_scale=sm_scale, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
        num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages, interpret=interpret,
        fp8_accumulation=bs.fp8_accumulation,
    )
    lse_p = pad_rows(lse, tp)
    if delta == "matched":
        delta_p = delta_kernels.matched_delta(q8, k8, v8, do8, lse_p, q_seg, kv_seg, **common_args)
    else:
        delta_p = delta_kernels.row_dot_delta(delta, do, o, do8, tp)
    dq, stats = bwd_kernels.dq_pass(
        q8, k8, v8, do8, lse_p, delta_p, q_seg, kv_seg, precision=precision,
        with_stats=with_stats, **common_args,
    )
    dk, dv = bwd_kernels.dkdv_pass(
        q8, k8, v8, do8, lse_p, delta_p, q_seg, kv_seg, precision=precision, **common_args,
    )

    def public(x, n, d, dtype):  # [B, H, Np, Dp] -> [B, N, H, D]
        return jnp.swapaxes(x[:, :, :n, :d], 1, 2).astype(dtype)

    return Gradients(
        public(dq, t, dqk, q.dtype),
        public(dk, s, dqk, k.dtype),
        public(dv, s, dv_dim, v.dtype),
        delta_p[:, :, :t],
        tuple(x[:, :, :t] for x in stats) if with_stats else None,
    )
