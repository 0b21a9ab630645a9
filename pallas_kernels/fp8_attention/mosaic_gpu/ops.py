"""Entry points of the Mosaic GPU backend on the public layout ([B, T, H, D]).

Quantize (one fused XLA pass per operand), run the kernels, unpad. No autodiff here.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu import quantize as xla_quantize
from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import pad_segment_ids


def quantize_operands(q, k, v, config: MosaicConfig, interpret: bool = False):
    """(Q, K, V) for the forward: values of Q and K, the permuted K-major copy of V."""
    if config.fused_quantize:
        quantize = functools.partial(quantize_kernel.quantize, interpret=interpret)
    else:
        quantize = xla_quantize.quantize
    return quantize(q), quantize(k), quantize(v, values=False, k_major=True)


def forward(q, k, v, q_ids=None, kv_ids=None, *, causal: bool, sm_scale: float,
            config: MosaicConfig = MosaicConfig(), interpret: bool = False):
    """FP8 flash forward: (out [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] f32)."""
    t, s = q.shape[1], k.shape[1]
    q8, k8, v8 = quantize_operands(q, k, v, config, interpret)
    kv_inv = jnp.stack([k8.inv_rows, v8.inv_rows], axis=3)  # [B, Hkv, Sp / 128, 2, 64]
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    segments = q_ids is not None
    q_seg = pad_segment_ids(q_ids, tp, -1) if segments else None
    kv_seg = pad_segment_ids(kv_ids, sp, -2) if segments else None
    mask = fwd_kernel.ForwardMask(t=t, s=s, causal=causal, segments=segments)
    out_dtype = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.float32
    o, lse = fwd_kernel.forward(
        q8.values, q8.inv_tokens, k8.values, v8.values_t, kv_inv, q_seg, kv_seg, mask=mask,
        sm_scale=sm_scale, stages=config.stages, out_dtype=out_dtype, interpret=interpret,
    )
    return o[:, :t].astype(q.dtype), lse[:, :, :t]
