"""The Mosaic GPU backend's ops module (:class:`..api.KernelOps`), public layout [B, T, H, D].

The forward is this folder's FA3-style FP8 kernel; the matched delta, dQ and dK/dV passes
are this folder's backward kernels (:mod:`.backward`) where they support the call
(:func:`.backward_ops.reason`), else the Triton backend's passes on the Mosaic forward's
log-sum-exp (the same natural-log convention). Either way one set of passes forms delta
and dS, so Delta-Matching's row sums cancel.
No autodiff here: ``dm_jax`` wraps forward and backward in its ``jax.custom_vjp``.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.api import AttentionSpec, ForwardResult, Pass
from pallas_kernels.fp8_attention.mosaic_gpu import backward_ops, documents
from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig, default_config, supported
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import pad_segment_ids
from pallas_kernels.fp8_attention.triton import ops as triton_ops

Config = MosaicConfig
__all__ = ["Config", "backward", "default_config", "delta", "forward", "passes", "supported"]


def _longest_first(config: MosaicConfig) -> bool:
    """Whether causal query tiles launch longest first: ``config.causal_order``'s choice, on
    the GPU and in Pallas' GPU interpreter alike (which, given the CPU threads it needs,
    runs the reversed order with GQA too: docs/mosaic_gpu.md, "The CPU twin")."""
    return config.causal_order == "longest_first"


def quantize_operands(q, k, v, config: MosaicConfig, interpret: bool = False, shared=False):
    """(Q, K, V) for the forward: values of Q and K, the permuted K-major copy of V.
    ``shared``: the backward's calls instead (:func:`.backward_ops.quantize_all`), which
    also form what the forward does not read (``MosaicConfig.shared_quantize``)."""
    quantize = quantize_kernel.quantizer(config.fused_quantize, interpret, config.quantize_warps)
    if shared:
        return backward_ops.quantize_all(quantize, q, k, v, shared=True)
    return quantize(q), quantize(k), quantize(v, values=False, k_major=True)


def _kernel_operands(q8, k8, v8):
    """The forward kernel's arguments from the quantized operands: a bad query row gets NaN
    in its decode factor, a bad key (K or V row) NaN in its poison and its (batch, kv head)
    a poison flag."""
    b, hkv, sp = k8.nonfinite.shape
    bad_keys = k8.nonfinite | v8.nonfinite
    k_poison = numerics.poison(bad_keys).reshape(b, hkv, sp // 128, 128)
    kv_aux = jnp.concatenate([k8.inv_rows, v8.inv_rows, k_poison], axis=3)  # [.., 256]
    q_inv = q8.inv_tokens + numerics.poison(q8.nonfinite)
    kv_flags = fwd_kernel.poison_flags(bad_keys)
    return q8.values, q_inv, k8.values, v8.values_t, kv_aux, kv_flags


def forward(
    q,
    k,
    v,
    q_ids=None,
    kv_ids=None,
    *,
    spec: AttentionSpec,
    config: MosaicConfig = MosaicConfig(),
    interpret: bool = False,
) -> ForwardResult:
    """FP8 flash forward: out [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] f32.

    The kernel's tiles are its own (64 query rows per warpgroup, 128-key tiles), not
    ``spec.tiles``' forward tiles: those only order the online-softmax updates (FP32
    rounding); the emulation with ``block_k=128`` describes this kernel tile for tile.
    """
    t, s = q.shape[1], k.shape[1]
    shared = config.shared_quantize and _mosaic_backward(q, v, spec, config)
    q8, k8, v8 = quantize_operands(q, k, v, config, interpret, shared)
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    segments = q_ids is not None
    q_seg = pad_segment_ids(q_ids, tp, -1) if segments else None
    kv_seg = pad_segment_ids(kv_ids, sp, -2) if segments else None
    mask = fwd_kernel.ForwardMask(t=t, s=s, causal=spec.causal, segments=segments)
    doc_tiles = None
    if segments and config.document_tiles:
        doc_tiles = documents.query_tiles(q_seg, kv_seg, mask, fwd_kernel.BLOCK)
    o, lse = fwd_kernel.forward(
        *_kernel_operands(q8, k8, v8),
        q_seg,
        kv_seg,
        mask=mask,
        sm_scale=spec.sm_scale,
        stages=config.stages,
        out_dtype=fwd_kernel.kernel_dtype(q.dtype),
        interpret=interpret,
        longest_first=_longest_first(config),
        doc_tiles=doc_tiles,
    )
    return ForwardResult(o[:, :t].astype(q.dtype), lse[:, :, :t])


def backward_kernels(q, v, spec, config: MosaicConfig) -> str:
    """ "mosaic" where this backend's backward kernels run the call, else "triton" (the
    Triton passes behind the Mosaic forward: ``backward_ops.reason`` says why)."""
    return "mosaic" if _mosaic_backward(q, v, spec, config) else "triton"


def _mosaic_backward(q, v, spec, config: MosaicConfig) -> bool:
    """Whether this backend's backward kernels run the call."""
    if not config.mosaic_backward:
        return False
    wide = config.backward_wide_heads
    launches = config.backward_wide_launches
    return (
        backward_ops.reason(q.shape, v.shape, q.dtype, spec, wide_heads=wide, launches=launches)
        is None
    )


def _operands(q, k, v, lse, do, q_ids, kv_ids, spec, config: MosaicConfig, interpret):
    return backward_ops.operands(
        q,
        k,
        v,
        lse,
        do,
        q_ids,
        kv_ids,
        spec=spec,
        stages=config.backward_stages,
        fused_quantize=config.fused_quantize,
        interpret=interpret,
        delta_key_tile=config.delta_key_tile,
        pingpong=config.backward_pingpong,
        quantize_warps=config.quantize_warps,
        dq_in_key_pass=config.backward_dq == "key_pass",
        wide_launches=config.backward_wide_launches,
        longest_first=_longest_first(config),
        document_tiles=config.document_tiles,
        piece_columns=config.backward_piece_columns,
        shared_quantize=config.shared_quantize,
        early_p=config.backward_early_p,
        chained_dots=config.backward_chained_dots,
        key_operand_registers=config.backward_key_registers,
        query_operand_registers=config.backward_query_registers,
    )


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
    config: MosaicConfig,
    interpret: bool,
):
    """delta_i [B, Hq, T] f32 of ``spec.delta``, formed as :func:`backward` forms it."""
    if _mosaic_backward(q, v, spec, config):
        ops = _operands(q, k, v, lse, do, q_ids, kv_ids, spec, config, interpret)
        return backward_ops.delta(ops, do, out, spec.delta)[:, :, : q.shape[1]]
    return triton_ops.delta(
        q,
        k,
        v,
        out,
        lse,
        do,
        q_ids,
        kv_ids,
        spec=spec,
        interpret=interpret,
        config=config.backward_config(q.shape[-1], v.shape[-1]),
    )


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
    config: MosaicConfig,
    interpret: bool,
    with_stats: bool = False,
):
    """Flash backward with recomputed P (see the module docstring for which kernels)."""
    if _mosaic_backward(q, v, spec, config):
        ops = _operands(q, k, v, lse, do, q_ids, kv_ids, spec, config, interpret)
        dtypes = (q.dtype, k.dtype, v.dtype)
        return backward_ops.backward(ops, do, out, spec.delta, dtypes, with_stats)
    return triton_ops.backward(
        q,
        k,
        v,
        out,
        lse,
        do,
        q_ids,
        kv_ids,
        spec=spec,
        config=config.backward_config(q.shape[-1], v.shape[-1]),
        interpret=interpret,
        with_stats=with_stats,
    )


def passes(q, k, v, do, *, spec: AttentionSpec, config: MosaicConfig, interpret: bool) -> dict:
    """{name: Pass}: the quantize pre-pass and the forward kernel of this backend, then the
    backward's passes: this backend's where it runs the call, else the Triton backend's
    (prefixed ``triton_``). No segment ids."""
    mask = fwd_kernel.ForwardMask(t=q.shape[1], s=k.shape[1], causal=spec.causal, segments=False)

    def quantize_fwd(q, k, v):
        return quantize_operands(q, k, v, config, interpret)

    def forward_kernel(*operands):
        return fwd_kernel.forward(
            *operands,
            mask=mask,
            sm_scale=spec.sm_scale,
            stages=config.stages,
            out_dtype=fwd_kernel.kernel_dtype(q.dtype),
            interpret=interpret,
            longest_first=_longest_first(config),
        )

    out = {
        "quantize_fwd": Pass(quantize_fwd, (q, k, v), 0),
        "forward_kernel": Pass(forward_kernel, _kernel_operands(*quantize_fwd(q, k, v)), 2),
    }
    if _mosaic_backward(q, v, spec, config):
        o, lse = forward(q, k, v, spec=spec, config=config, interpret=interpret)
        out.update(_backward_passes(q, k, v, o, lse, do, spec, config, interpret))
        return out
    borrowed = triton_ops.passes(
        q,
        k,
        v,
        do,
        spec=spec,
        interpret=interpret,
        config=config.backward_config(q.shape[-1], v.shape[-1]),
    )
    out.update(
        {
            f"triton_{name}": p
            for name, p in borrowed.items()
            if name not in ("quantize_fwd", "forward_kernel")
        }
    )
    return out


def _backward_passes(q, k, v, o, lse, do, spec, config, interpret) -> dict:
    """The Mosaic backward's passes, each on its own inputs."""
    ops = _operands(q, k, v, lse, do, None, None, spec, config, interpret)
    static = dict(
        kwargs=ops.kwargs,
        delta_key_tile=ops.delta_key_tile,
        dq_key_tile=ops.dq_key_tile,
        dq_in_key_pass=ops.dq_in_key_pass,
        wide_launches=ops.wide_launches,
        longest_first=ops.longest_first,
        key_operand_registers=ops.key_operand_registers,
        query_operand_registers=ops.query_operand_registers,
    )

    def arrays_only(operands):  # a pass's arguments and results: arrays only
        return operands._replace(**dict.fromkeys(static))

    def quantize_bwd(q, k, v, lse, do):
        return arrays_only(_operands(q, k, v, lse, do, None, None, spec, config, interpret))

    delta_p = backward_ops.delta(ops, do, o, "matched")
    arrays = arrays_only(ops)

    def matched_delta(arrays):
        return backward_ops.delta(arrays._replace(**static), do, o, "matched")

    def stale_rowdot(do, o):
        return backward_ops.delta(ops, do, o, "stale")

    def dq_pass(arrays, delta_p):
        ops_ = arrays._replace(**static)
        return backward_ops.gradients(ops_, delta_p, (q.dtype, k.dtype), passes=("dq",))

    def dkdv_pass(arrays, delta_p):
        ops_ = arrays._replace(**static)
        return backward_ops.gradients(ops_, delta_p, (q.dtype, k.dtype), passes=("dkdv",))

    return {
        "quantize_bwd": Pass(quantize_bwd, (q, k, v, lse, do), 0),
        "delta_matched_kernel": Pass(matched_delta, (arrays,), 2),
        "delta_stale_rowdot": Pass(stale_rowdot, (do, o), 0),
        "dq_pass": Pass(dq_pass, (arrays, delta_p), 3),
        "dkdv_pass": Pass(dkdv_pass, (arrays, delta_p), 4),
    }
