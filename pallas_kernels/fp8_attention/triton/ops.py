"""The Triton backend's ops module (:class:`..api.KernelOps`): quantize, run the kernels, unpad.

Entry points take the public layout ([B, T, H, D]). No autodiff here: ``dm_jax`` wraps
:func:`forward` and :func:`backward` in a ``jax.custom_vjp`` through its backend registry.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.api import AttentionSpec, BackwardResult, ForwardResult, Pass
from pallas_kernels.fp8_attention.triton import backward as bwd_kernels
from pallas_kernels.fp8_attention.triton import delta as delta_kernels
from pallas_kernels.fp8_attention.triton import forward as fwd_kernels
from pallas_kernels.fp8_attention.triton.common import MaskSpec
from pallas_kernels.fp8_attention.triton.config import (
    TritonConfig,
    default_config,
    dkdv_block_k,
    supported,
)
from pallas_kernels.fp8_attention.triton.quantize import (
    QuantizedTensor,
    pad_rows,
    pad_segment_ids,
    padded_length,
    quantize,
    with_poison,
)

Config = TritonConfig
__all__ = ["Config", "backward", "default_config", "delta", "forward", "passes", "supported"]


def _mask(q, k, q_ids, causal):
    t, s = q.shape[1], k.shape[1]
    return MaskSpec(
        t=t,
        s=s,
        causal=causal,
        segments=q_ids is not None,
        padded=(t, s) != (padded_length(t), padded_length(s)),
    )


def _segments(q_ids, kv_ids, tp, sp):
    return pad_segment_ids(q_ids, tp, -1), pad_segment_ids(kv_ids, sp, -2)


def _forward_call(q8, k8, v8, q_seg, kv_seg, *, mask, spec, config, out_dtype, interpret):
    """The forward kernel on quantized operands: padded (o [B, Hq, Tp, Dvp], lse [B, Hq, Tp])."""
    return fwd_kernels.forward(
        q8,
        k8,
        v8,
        q_seg,
        kv_seg,
        mask=mask,
        sm_scale=spec.sm_scale,
        precision=spec.precision,
        block_q=spec.tiles.block_q,
        block_k=spec.tiles.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        out_dtype=out_dtype,
        interpret=interpret,
        fp8_accumulation=config.fp8_accumulation,
    )


def forward(
    q, k, v, q_ids=None, kv_ids=None, *, spec: AttentionSpec, config: TritonConfig, interpret: bool
) -> ForwardResult:
    """Flash forward: out [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] f32."""
    t, dv = q.shape[1], v.shape[3]
    precision = spec.precision
    q8, k8, v8 = _poisoned_forward(
        quantize(q, precision), quantize(k, precision), quantize(v, precision, k_major=True)
    )
    q_seg, kv_seg = _segments(q_ids, kv_ids, q8.values.shape[2], k8.values.shape[2])
    o, lse = _forward_call(
        q8,
        k8,
        v8,
        q_seg,
        kv_seg,
        mask=_mask(q, k, q_ids, spec.causal),
        spec=spec,
        config=config,
        out_dtype=q.dtype,
        interpret=interpret,
    )
    return ForwardResult(jnp.swapaxes(o[:, :, :t, :dv], 1, 2), lse[:, :, :t])


def _poisoned_forward(q8, k8, v8):
    """Scores of bad query rows (Q) and bad keys (K or V) become NaN, wherever visible."""
    return with_poison(q8, q8.nonfinite), with_poison(k8, k8.nonfinite, v8.nonfinite), v8


class _BackwardOperands(NamedTuple):
    """What the delta, dQ and dK/dV passes read: operands quantized with their K-major
    copies, padded segment ids and lse, and the keyword arguments of every pass."""

    q8: QuantizedTensor
    k8: QuantizedTensor
    v8: QuantizedTensor
    do8: QuantizedTensor
    q_seg: Optional[jax.Array]
    kv_seg: Optional[jax.Array]
    lse: jax.Array  # [B, Hq, Tp], NaN (rows that saw a bad token) zeroed and poisoned in q8
    kwargs: dict


def _quantize_backward(q, k, v, do, precision):
    """q, k, dO with their K-major copies, v without: the layouts the backward passes read."""
    return (
        quantize(q, precision, k_major=True),
        quantize(k, precision, k_major=True),
        quantize(v, precision),
        quantize(do, precision, k_major=True),
    )


def _backward_operands(q, k, v, lse, do, q_ids, kv_ids, spec, config, interpret):
    q8, k8, v8, do8 = _quantize_backward(q, k, v, do, spec.precision)
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    lse = pad_rows(lse, tp)
    q8, k8, v8 = _poisoned_forward(q8, k8, v8)
    q8 = with_poison(q8, do8.nonfinite, jnp.isnan(lse))  # +inf (rows that see nothing) stays
    q_seg, kv_seg = _segments(q_ids, kv_ids, tp, sp)
    kwargs = dict(
        mask=_mask(q, k, q_ids, spec.causal),
        sm_scale=spec.sm_scale,
        block_q=spec.tiles.bwd_block_q,
        block_k=spec.tiles.bwd_block_k,
        num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages,
        interpret=interpret,
        fp8_accumulation=config.fp8_accumulation,
    )
    lse = jnp.where(jnp.isnan(lse), 0.0, lse)
    return _BackwardOperands(q8, k8, v8, do8, q_seg, kv_seg, lse, kwargs)


def _dkdv_kwargs(ops: _BackwardOperands, spec: AttentionSpec, config: TritonConfig) -> dict:
    """The dK/dV pass's keyword arguments, with its own key width (see dkdv_block_k)."""
    return dict(ops.kwargs, block_k=dkdv_block_k(spec.tiles, config))


def _ds_operands(ops: _BackwardOperands, delta_p):
    """The dQ and dK/dV passes' operands: a non-finite delta row is zeroed and poisons its
    row's scores instead (a masked pair would multiply it by P = 0)."""
    q8 = with_poison(ops.q8, ~jnp.isfinite(delta_p))
    delta_ds = numerics.finite_or_zero(delta_p)
    return (q8, ops.k8, ops.v8, ops.do8, ops.lse, delta_ds, ops.q_seg, ops.kv_seg)


def _delta(ops: _BackwardOperands, do, out, mode):
    """delta [B, Hq, Tp]: the matched pre-pass kernel, or the row dot of dO (or dO^) and O."""
    if mode == "matched":
        return delta_kernels.matched_delta(
            ops.q8, ops.k8, ops.v8, ops.do8, ops.lse, ops.q_seg, ops.kv_seg, **ops.kwargs
        )
    return delta_kernels.row_dot_delta(mode, do, out, ops.do8, ops.lse.shape[2])


def delta(
    q,
    k,
    v,
    out,
    lse,
    do,
    q_ids=None,
    kv_ids=None,
    *,
    spec: AttentionSpec,
    config: TritonConfig,
    interpret: bool,
):
    """delta_i [B, Hq, T] f32 of ``spec.delta``, as :func:`backward` forms it."""
    ops = _backward_operands(q, k, v, lse, do, q_ids, kv_ids, spec, config, interpret)
    return _delta(ops, do, out, spec.delta)[:, :, : q.shape[1]]


def backward(
    q,
    k,
    v,
    out,
    lse,
    do,
    q_ids=None,
    kv_ids=None,
    *,
    spec: AttentionSpec,
    config: TritonConfig,
    interpret: bool,
    with_stats: bool = False,
) -> BackwardResult:
    """Flash backward with recomputed P; see :mod:`.backward` for the equations."""
    t, s = q.shape[1], k.shape[1]
    dqk, dv_dim = q.shape[3], v.shape[3]
    ops = _backward_operands(q, k, v, lse, do, q_ids, kv_ids, spec, config, interpret)
    delta_p = _delta(ops, do, out, spec.delta)
    operands = _ds_operands(ops, delta_p)
    ds_scale = spec.tiles.ds_scale
    dq, stats = bwd_kernels.dq_pass(
        *operands, precision=spec.precision, with_stats=with_stats, ds_scale=ds_scale, **ops.kwargs
    )
    dk, dv = bwd_kernels.dkdv_pass(
        *operands, precision=spec.precision, ds_scale=ds_scale, **_dkdv_kwargs(ops, spec, config)
    )

    def public(x, n, d, dtype):  # [B, H, Np, Dp] -> [B, N, H, D]
        return jnp.swapaxes(x[:, :, :n, :d], 1, 2).astype(dtype)

    return BackwardResult(
        public(dq, t, dqk, q.dtype),
        public(dk, s, dqk, k.dtype),
        public(dv, s, dv_dim, v.dtype),
        delta_p[:, :, :t],
        *(x[:, :, :t] for x in stats),
    )


def passes(q, k, v, do, *, spec: AttentionSpec, config: TritonConfig, interpret: bool) -> dict:
    """{name: Pass} of this backend: the quantize pre-passes of the forward and of the
    backward, the forward kernel, the matched-delta kernel, the stale row dot, the dQ pass and
    the dK/dV pass, each on its own inputs (no segment ids)."""
    precision = spec.precision

    def quantize_fwd(q, k, v):
        return quantize(q, precision), quantize(k, precision), quantize(v, precision, k_major=True)

    def quantize_bwd(q, k, v, do):
        return _quantize_backward(q, k, v, do, precision)

    mask = _mask(q, k, None, spec.causal)
    fwd_operands = quantize_fwd(q, k, v)
    out, lse = forward(q, k, v, spec=spec, config=config, interpret=interpret)
    ops = _backward_operands(q, k, v, lse, do, None, None, spec, config, interpret)
    delta_p = _delta(ops, do, out, "matched")
    operands = _ds_operands(ops, delta_p)[:6]

    def forward_kernel(q8, k8, v8):
        return _forward_call(
            q8,
            k8,
            v8,
            None,
            None,
            mask=mask,
            spec=spec,
            config=config,
            out_dtype=q.dtype,
            interpret=interpret,
        )

    def matched_delta(*a):
        return delta_kernels.matched_delta(*a, None, None, **ops.kwargs)

    def stale_rowdot(do, out):
        return delta_kernels.row_dot_delta("stale", do, out, ops.do8, ops.lse.shape[2])

    ds_kw = dict(ops.kwargs, ds_scale=spec.tiles.ds_scale)

    def dq_pass(*a):
        return bwd_kernels.dq_pass(*a, None, None, precision=precision, **ds_kw)[0]

    def dkdv_pass(*a):
        kw = dict(_dkdv_kwargs(ops, spec, config), ds_scale=spec.tiles.ds_scale)
        return bwd_kernels.dkdv_pass(*a, None, None, precision=precision, **kw)

    return {
        "quantize_fwd": Pass(quantize_fwd, (q, k, v), 0),
        "forward_kernel": Pass(forward_kernel, fwd_operands, 2),
        "quantize_bwd": Pass(quantize_bwd, (q, k, v, do), 0),
        "delta_matched_kernel": Pass(matched_delta, operands[:5], 2),
        "delta_stale_rowdot": Pass(stale_rowdot, (do, out), 0),
        "dq_pass": Pass(dq_pass, operands, 3),
        "dkdv_pass": Pass(dkdv_pass, operands, 4),
    }
