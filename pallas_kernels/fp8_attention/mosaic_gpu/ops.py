"""The Mosaic GPU backend's ops module (:class:`..api.KernelOps`), public layout [B, T, H, D].

The forward is this folder's FA3-style FP8 kernel. The matched delta, dQ and dK/dV passes
are, until their Mosaic GPU versions exist, the Triton backend's kernels on the Mosaic
forward's log-sum-exp (the same natural-log convention): delta and dS are then formed by
the same passes, so Delta-Matching's row sums cancel exactly as on the Triton backend.
No autodiff here: ``dm_jax`` wraps forward and backward in its ``jax.custom_vjp``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.fp8_attention.api import AttentionSpec, ForwardResult, Pass
from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu import quantize as xla_quantize
from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig, default_config, supported
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import pad_segment_ids
from pallas_kernels.fp8_attention.triton import ops as triton_ops

Config = MosaicConfig
__all__ = ["Config", "backward", "default_config", "delta", "forward", "passes", "supported"]


def quantize_operands(q, k, v, config: MosaicConfig, interpret: bool = False):
    """(Q, K, V) for the forward: values of Q and K, the permuted K-major copy of V."""
    if config.fused_quantize:
        quantize = functools.partial(quantize_kernel.quantize, interpret=interpret)
    else:
        quantize = xla_quantize.quantize
    return quantize(q), quantize(k), quantize(v, values=False, k_major=True)


def _kernel_operands(q8, k8, v8):
    """The forward kernel's arguments from the quantized operands."""
    kv_inv = jnp.stack([k8.inv_rows, v8.inv_rows], axis=3)  # [B, Hkv, Sp / 128, 2, 64]
    return q8.values, q8.inv_tokens, k8.values, v8.values_t, kv_inv


def _out_dtype(dtype):
    return dtype if dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.float32


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
    q8, k8, v8 = quantize_operands(q, k, v, config, interpret)
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    segments = q_ids is not None
    q_seg = pad_segment_ids(q_ids, tp, -1) if segments else None
    kv_seg = pad_segment_ids(kv_ids, sp, -2) if segments else None
    mask = fwd_kernel.ForwardMask(t=t, s=s, causal=spec.causal, segments=segments)
    o, lse = fwd_kernel.forward(
        *_kernel_operands(q8, k8, v8),
        q_seg,
        kv_seg,
        mask=mask,
        sm_scale=spec.sm_scale,
        stages=config.stages,
        out_dtype=_out_dtype(q.dtype),
        interpret=interpret,
    )
    return ForwardResult(o[:, :t].astype(q.dtype), lse[:, :, :t])


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
    """delta_i [B, Hq, T] f32 of ``spec.delta`` (the Triton passes, as :func:`backward`)."""
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
    """Flash backward with recomputed P (the Triton passes; see the module docstring)."""
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
    backward passes it borrows from the Triton backend (no segment ids)."""
    mask = fwd_kernel.ForwardMask(t=q.shape[1], s=k.shape[1], causal=spec.causal, segments=False)

    def quantize_fwd(q, k, v):
        return quantize_operands(q, k, v, config, interpret)

    def forward_kernel(*operands):
        return fwd_kernel.forward(
            *operands,
            mask=mask,
            sm_scale=spec.sm_scale,
            stages=config.stages,
            out_dtype=_out_dtype(q.dtype),
            interpret=interpret,
        )

    out = {
        "quantize_fwd": Pass(quantize_fwd, (q, k, v), 0),
        "forward_kernel": Pass(forward_kernel, _kernel_operands(*quantize_fwd(q, k, v)), 2),
    }
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
