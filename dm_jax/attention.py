"""The public FP8 attention op: input checks, backend dispatch, custom VJP."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from dm_jax import numerics
from dm_jax.backends import BACKENDS, IMPLEMENTATIONS, get_backend
from dm_jax.masking import split_segment_ids
from dm_jax.reference import DELTA_MODES
from pallas_kernels.fp8_attention.triton.config import BlockSizes, default_block_sizes


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static settings of one attention call (hashable: a custom_vjp non-diff argument)."""

    causal: bool
    delta: str
    precision: str
    sm_scale: float
    implementation: str
    block_sizes: BlockSizes


def default_implementation() -> str:
    """"pallas" on a GPU, "reference" elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    delta: str = "matched",
    precision: str = "fp8",
    scale: Optional[float] = None,
    segment_ids=None,
    implementation: Optional[str] = None,
    block_sizes: Optional[BlockSizes] = None,
):
    """Flash attention with FP8 (or bf16) matmuls and a selectable softmax-backward delta.

    Args:
      q: [B, T, Hq, Dqk] queries.
      k: [B, S, Hkv, Dqk] keys; Hq % Hkv == 0 (GQA / MQA).
      v: [B, S, Hkv, Dv] values (Dv may differ from Dqk).
      causal: mask keys after the query position (top-left aligned).
      delta: "matched" (sum_j P_ij dP^_ij, zero dS row sums), "do_matched"
        (rowsum(dO^ * O)) or "stale" (rowsum(dO * O), what other kernels do).
      precision: "fp8" (E4M3 operands with block scales) or "bf16".
      scale: softmax scale, default Dqk ** -0.5.
      segment_ids: None, int [B, T] when T == S, or (q_ids [B, T], kv_ids [B, S]):
        queries attend only to keys of the same segment (packed sequences).
      implementation: None (pallas on GPU, reference elsewhere), "pallas",
        "pallas_interpret" (the kernels in Pallas interpret mode, any device) or
        "reference" (the pure-JAX emulation of the same numerics).
      block_sizes: tile sizes; default depends on the head dims.
    Returns:
      [B, T, Hq, Dv] in q's dtype.
    """
    config, q_ids, kv_ids = prepare_call(
        q, k, v, causal=causal, delta=delta, precision=precision, scale=scale,
        segment_ids=segment_ids, implementation=implementation, block_sizes=block_sizes,
    )
    return _attention(config, q, k, v, q_ids, kv_ids)


def prepare_call(q, k, v, *, causal, delta, precision, scale, segment_ids, implementation, block_sizes):
    """Check the arguments of :func:`attention` and resolve its defaults.

    Returns ``(config, q_segment_ids, kv_segment_ids)``; raises ValueError for bad input and
    the backend's NotImplementedError for what it cannot run.
    """
    q_ids, kv_ids = _check_inputs(q, k, v, delta, precision, scale, segment_ids, implementation)
    config = AttentionConfig(
        causal=bool(causal),
        delta=delta,
        precision=precision,
        sm_scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        implementation=implementation or default_implementation(),
        block_sizes=block_sizes or default_block_sizes(q.shape[-1], v.shape[-1]),
    )
    get_backend(config.implementation).check_supported(q, k, v, config)
    return config, q_ids, kv_ids


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, k, v, q_ids, kv_ids):
    out, _ = BACKENDS[config.implementation].forward(q, k, v, q_ids, kv_ids, config=config)
    return out


def _attention_fwd(config, q, k, v, q_ids, kv_ids):
    out, lse = BACKENDS[config.implementation].forward(q, k, v, q_ids, kv_ids, config=config)
    # Residuals: the inputs (re-quantized in the backward), O (stale / do_matched deltas)
    # and the log-sum-exp (recomputed P = exp(S - lse)).
    return out, (q, k, v, out, lse, q_ids, kv_ids)


def _attention_bwd(config, residuals, do):
    q, k, v, out, lse, q_ids, kv_ids = residuals
    grads = BACKENDS[config.implementation].backward(
        q, k, v, out, lse, do, q_ids, kv_ids, config=config, with_stats=False
    )
    return grads.dq, grads.dk, grads.dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _fail(argument, expected, got):
    raise ValueError(f"{argument}: expected {expected}, got {got}")


def _check_inputs(q, k, v, delta, precision, scale, segment_ids, implementation):
    """Validate arguments; return (q_segment_ids, kv_segment_ids) as int32 arrays or None."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            _fail(name, "a rank-4 array [batch, tokens, heads, head_dim]", f"shape {getattr(x, 'shape', type(x))}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            _fail(name, "a floating-point dtype", x.dtype)
    b, t, hq, dqk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        _fail("k, v", f"batch size {b} (from q)", f"k {k.shape}, v {v.shape}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        _fail("v", f"the tokens and heads of k {k.shape[:3]}", f"shape {v.shape}")
    if k.shape[3] != dqk:
        _fail("k", f"head dim {dqk} (q's head dim)", f"head dim {k.shape[3]}")
    if hq % k.shape[2]:
        _fail("k", f"a number of heads dividing q's {hq} heads (GQA/MQA)", f"{k.shape[2]} heads")
    if delta not in DELTA_MODES:
        _fail("delta", f"one of {DELTA_MODES}", repr(delta))
    if precision not in numerics.PRECISIONS:
        _fail("precision", f"one of {numerics.PRECISIONS}", repr(precision))
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        _fail("implementation", f"None or one of {IMPLEMENTATIONS}", repr(implementation))
    if scale is not None:
        if isinstance(scale, jax.core.Tracer) or not math.isfinite(float(scale)) or float(scale) <= 0:
            _fail("scale", "a positive finite Python number (static)", repr(scale))
    s = k.shape[1]
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)) and t != s:
        _fail("segment_ids", f"a (q_ids [B, {t}], kv_ids [B, {s}]) pair because T != S", "one array")
    if segment_ids is not None:
        raw = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,)
        if any(not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer) for ids in raw):
            _fail("segment_ids", "an integer dtype", [jnp.asarray(ids).dtype for ids in raw])
    q_ids, kv_ids = split_segment_ids(segment_ids)
    for name, ids, n in (("q segment_ids", q_ids, t), ("kv segment_ids", kv_ids, s)):
        if ids is not None and tuple(ids.shape) != (b, n):
            _fail(name, f"shape {(b, n)}", f"shape {tuple(ids.shape)}")
    return q_ids, kv_ids
