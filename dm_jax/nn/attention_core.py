"""The attention core of every attention layer: runs an experimental arm (`dm_jax.arms`), and
an adapter with the signature of `jax.nn.dot_product_attention` for existing Flax code.

Layout everywhere: q [B, T, Hq, Dqk], k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv] -> [B, T, Hq, Dv].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dm_jax import baselines, reference
from dm_jax.arms import ARMS, check_arm
from dm_jax.attention_op import attention

_CUDNN = {"fp8": "cudnn_fp8_attention", "bf16": "cudnn_bf16_attention"}  # precision -> baseline


def _xla(q, k, v, *, arm, causal, scale, segment_ids, implementation, precision, documents):
    del arm, implementation, precision, documents
    out = reference.mha_reference(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
    return out.astype(q.dtype)


def _dm_jax(q, k, v, *, arm, causal, scale, segment_ids, implementation, precision, documents):
    del documents
    return attention(
        q,
        k,
        v,
        causal=causal,
        delta=arm.delta,
        precision=precision,
        scale=scale,
        segment_ids=segment_ids,
        implementation=implementation,
    )


def _cudnn(q, k, v, *, arm, causal, scale, segment_ids, implementation, precision, documents):
    del arm, implementation
    packed = documents == "packed" and precision == "bf16"
    if packed and segment_ids is not None and not isinstance(segment_ids, (tuple, list)):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dv < dqk:  # MLA (192/128): cuDNN's packed path takes V as wide as Q and K
            v = jnp.pad(v, [(0, 0)] * 3 + [(0, dqk - dv)])
        out = baselines.cudnn_bf16_documents(
            q, k, v, causal=causal, scale=scale, segment_ids=segment_ids
        )
        return out[..., :dv]
    run = getattr(baselines, _CUDNN[precision])
    return run(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)


_CORES = {"xla": _xla, "dm_jax": _dm_jax, "cudnn": _cudnn}  # Arm.core -> function


def attention_core(
    q_BTHD,
    k_BSKD,
    v_BSKV,
    *,
    arm: str = "matched",
    causal: bool = True,
    scale: float | None = None,
    segment_ids=None,
    implementation=None,
    precision: str | None = None,
    documents: str = "mask",
) -> jax.Array:
    """Runs the attention core of arm `arm` (`dm_jax.arms.ARMS`); returns o_BTHV in q's dtype.

    `documents`: how the cuDNN BF16 core takes segment ids (`baselines.DOCUMENT_MODES`):
    "mask" (a dense [B, 1, T, S] mask) or "packed" (cuDNN's packed sequences,
    `baselines.cudnn_bf16_documents`); the other cores ignore it."""
    precision = check_arm(arm, precision)
    baselines.check_documents(documents)
    spec = ARMS[arm]
    return _CORES[spec.core](
        q_BTHD,
        k_BSKD,
        v_BSKV,
        arm=spec,
        causal=causal,
        scale=scale,
        segment_ids=segment_ids,
        implementation=implementation,
        precision=precision,
        documents=documents,
    )


# Keywords `flax.nnx.MultiHeadAttention` passes to its attention_fn besides q, k, v and mask.
_FLAX_KWARGS = (
    "dropout_rng",
    "dropout_rate",
    "broadcast_dropout",
    "deterministic",
    "dtype",
    "module",
)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    arm: str = "matched",
    segment_ids=None,
    attn_implementation=None,
    precision=None,
    **flax_kwargs,
):
    """Drop-in for `jax.nn.dot_product_attention` backed by `dm_jax.attention`.

    query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H]. `flax.nnx.MultiHeadAttention`
    accepts it as `attention_fn` (use `functools.partial(dot_product_attention, arm=...)`);
    pass causality as `is_causal=True` (nnx.MultiHeadAttention forwards its `is_causal` call
    argument) rather than a dense mask. `implementation` here is jax's argument name; the
    `dm_jax.attention` backend is `attn_implementation`. Flax's extra arguments (dropout,
    dtype, module, and its lax `precision`) are accepted: dropout must be off.

    Raises ValueError for a bias, a mask, sequence lengths, a local window or active dropout:
    the FP8 op has none of these (packed documents go through `segment_ids`); TypeError for
    any other keyword (`causal=` included: its name here is `is_causal`), which would
    otherwise be dropped without effect.
    """
    unknown = sorted(set(flax_kwargs) - set(_FLAX_KWARGS))
    if unknown:
        raise TypeError(
            f"dot_product_attention: unexpected keyword arguments {unknown}; causality "
            f"is is_causal=True, the attention backend attn_implementation="
        )
    unsupported = {
        "bias": bias,
        "mask": mask,
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
        "local_window_size": local_window_size,
        "implementation": implementation,
    }
    for name, val in unsupported.items():
        if val is not None:
            raise ValueError(
                f"{name}: not supported by dm_jax attention (use is_causal=True or "
                f"segment_ids); got a value"
            )
    del precision  # flax passes its lax.Precision for einsums; the arm sets our precision
    if flax_kwargs.get("dropout_rate", 0.0) and not flax_kwargs.get("deterministic", True):
        raise ValueError("dropout_rate: attention dropout is not supported, set it to 0")
    dtype = flax_kwargs.get("dtype") or query.dtype
    out = attention_core(
        query,
        key,
        value,
        arm=arm,
        causal=is_causal,
        scale=scale,
        segment_ids=segment_ids,
        implementation=attn_implementation,
    )
    return out.astype(dtype)
