"""Diagnostics that show stale delta versus Delta-Matching: dS row sums, channel gains."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from dm_jax import backends
from dm_jax.reference import attention_probabilities
from dm_jax.attention_op import is_empty, prepare_call


def row_sum_residuals(
    q,
    k,
    v,
    do,
    *,
    causal: bool = False,
    delta: str = "matched",
    precision: str = "fp8",
    scale: Optional[float] = None,
    segment_ids=None,
    implementation: Optional[str] = None,
    tiles=None,
    config=None,
):
    """Normalized dS row sums ``|sum_j dS_ij| / sum_j |dS_ij|`` of one attention call.

    Runs the forward and the backward of :func:`dm_jax.attention` (same arguments) under the
    cotangent ``do`` [B, T, Hq, Dv] and reads the row statistics of dS.

    Returns:
      dict with ``pre_cast`` (dS in FP32, before its cast to FP8) and ``post_cast``
      (the decoded FP8 dS the dQ/dK matmuls use), each [B, Hq, T] float32. Rows whose dS
      is all zero (fully masked, or no keys at all) report 0.
    """
    call, q_ids, kv_ids = prepare_call(
        q,
        k,
        v,
        causal=causal,
        delta=delta,
        precision=precision,
        scale=scale,
        segment_ids=segment_ids,
        implementation=implementation,
        tiles=tiles,
        config=config,
    )
    if do.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"do: expected shape {q.shape[:3] + v.shape[3:]}, got {do.shape}")
    if is_empty(q, k, v):
        zeros = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
        return {"pre_cast": zeros, "post_cast": zeros}
    backend, spec = backends.get(call.implementation), call.spec
    out, lse = backend.forward(q, k, v, q_ids, kv_ids, spec=spec, config=call.config)
    res = backend.backward(
        q,
        k,
        v,
        out,
        lse,
        do.astype(out.dtype),
        q_ids,
        kv_ids,
        spec=spec,
        config=call.config,
        with_stats=True,
    )

    def ratio(row_sum, abs_sum):
        return jnp.abs(row_sum) / jnp.where(abs_sum == 0, 1.0, abs_sum)

    return {
        "pre_cast": ratio(res.ds_rowsum_pre, res.ds_abssum_pre),
        "post_cast": ratio(res.ds_rowsum_post, res.ds_abssum_post),
    }


def gain_statistics(g_q, g_k, *, top: int = 4):
    """Channel-gain concentration of one QK-RMSNorm pair.

    Args:
      g_q, g_k: [D] query and key RMSNorm gains of one attention layer.
    Returns:
      dict: ``product`` [D] = g_q * g_k; ``max_gain`` = max(|g_q|, |g_k|);
      ``max_product`` = max |g_q g_k|; ``top_channels`` [top] indices of the largest
      |g_q g_k|; ``top1_share`` / ``top4_share``: the share of sum_c (g_q,c g_k,c)^2
      held by the largest 1 / 4 channels.
    """
    g_q = jnp.asarray(g_q, jnp.float32)
    g_k = jnp.asarray(g_k, jnp.float32)
    if g_q.ndim != 1 or g_q.shape != g_k.shape:
        raise ValueError(
            f"g_q, g_k: expected two vectors of one length, got {g_q.shape}, {g_k.shape}"
        )
    product = g_q * g_k
    energy = jnp.sort(product**2)[::-1]
    total = jnp.maximum(jnp.sum(energy), jnp.finfo(jnp.float32).tiny)
    return {
        "product": product,
        "max_gain": jnp.maximum(jnp.max(jnp.abs(g_q)), jnp.max(jnp.abs(g_k))),
        "max_product": jnp.max(jnp.abs(product)),
        "top_channels": jnp.argsort(-jnp.abs(product))[:top],
        "top1_share": energy[0] / total,
        "top4_share": jnp.sum(energy[:4]) / total,
    }


def attention_peakiness(
    q, k, *, causal: bool = False, scale: Optional[float] = None, segment_ids=None
):
    """Largest attention probability of every query row, max_j P_ij, of high-precision
    attention (1: one key takes all the attention; 1/n: uniform over n visible keys).

    Args:
      q: [B, T, Hq, Dqk]; k: [B, S, Hkv, Dqk]; causal, scale, segment_ids as
        :func:`dm_jax.attention`.
    Returns:
      [B, Hq, T] float32; rows with no visible key report 0.
    """
    if q.ndim != 4 or k.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q, k: expected [B, T, Hq, D] and [B, S, Hkv, D] with Hq % Hkv == 0, got "
            f"{q.shape}, {k.shape}"
        )
    p = attention_probabilities(q, k, causal=causal, scale=scale, segment_ids=segment_ids)
    b, hkv, group, t, _ = p.shape
    return jnp.max(p, axis=-1).reshape(b, hkv * group, t)
