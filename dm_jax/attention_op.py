"""The public FP8 attention op (``dm_jax.attention``): argument checks, backend dispatch
through :mod:`dm_jax.backends`, and the custom VJP around the backend's forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from dm_jax import backends, numerics
from dm_jax.masking import split_segment_ids
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.tiles import NumericsTiles, default_tiles

# Largest softmax scale accepted. FP8 and bf16 flash attention keep the scaled logits in f32
# and recompute them (online softmax, then P = exp(S - lse) in the backward); once the f32
# spacing of the logits nears exp's range (|S| around 1e9, reached by unit-normal inputs at
# a scale of about 1e8) a recomputed logit can exceed the row maximum it was measured
# against and results turn to NaN.
MAX_SCALE = 2.0**16


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One resolved call (hashable: the custom_vjp's non-differentiable argument).

    spec: the numbers to compute; implementation: the registered backend that runs it;
    config: that backend's launch settings.
    """

    spec: AttentionSpec
    implementation: str
    config: Any


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
    tiles: Optional[NumericsTiles] = None,
    config=None,
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
      scale: softmax scale in (0, MAX_SCALE], default Dqk ** -0.5.
      segment_ids: None, int [B, T] when T == S, or (q_ids [B, T], kv_ids [B, S]):
        queries attend only to keys of the same segment (packed sequences).
      implementation: None (best available: "pallas" on a GPU, "reference" elsewhere),
        "pallas" (the fastest Pallas backend that serves the call), "triton", "mosaic",
        "reference" (the pure-JAX emulation of the same numerics), or the interpret twins
        "triton_interpret" (alias "pallas_interpret") and "mosaic_interpret" (any host).
      tiles: the tiles that change results (NumericsTiles); default per head dim.
      config: launch settings of the backend (e.g. a TritonConfig); default per head dim.
        With "pallas", its type picks the backend.
    Returns:
      [B, T, Hq, Dv] in q's dtype. Rows with no visible key (S == 0, segments) are 0; an empty
      batch, query set or head set gives an empty result.
    """
    call, q_ids, kv_ids = prepare_call(
        q, k, v, causal=causal, delta=delta, precision=precision, scale=scale,
        segment_ids=segment_ids, implementation=implementation, tiles=tiles, config=config,
    )  # fmt: skip
    if is_empty(q, k, v):
        return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    shared = call.implementation not in _EAGER_ONLY
    return (_shared_attention if shared else _attention)(call, q, k, v, q_ids, kv_ids)


def prepare_call(
    q, k, v, *, causal, delta, precision, scale, segment_ids, implementation, tiles, config
):
    """Check the arguments of :func:`attention` and resolve its defaults and backend.

    Returns ``(AttentionConfig, q_segment_ids, kv_segment_ids)``; raises ValueError for bad
    input and NotImplementedError for what the chosen backend cannot run.
    """
    q_ids, kv_ids = _check_inputs(q, k, v, delta, precision, scale, segment_ids, implementation)
    if tiles is not None and not isinstance(tiles, NumericsTiles):
        _fail("tiles", "None or a NumericsTiles", type(tiles).__name__)
    spec = AttentionSpec(
        causal=bool(causal),
        delta=delta,
        precision=precision,
        sm_scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        tiles=tiles or default_tiles(q.shape[-1], v.shape[-1]),
    )
    empty = is_empty(q, k, v)
    backend, config = backends.resolve(implementation, q, k, v, spec, config, empty=empty)
    return AttentionConfig(spec, backend.name, config), q_ids, kv_ids


def is_empty(q, k, v) -> bool:
    """No output element to compute, or no key to attend to (the output is all zeros)."""
    return 0 in (q.shape[0], q.shape[1], q.shape[2], v.shape[3], k.shape[1])


def _backend(call: AttentionConfig):
    return backends.get(call.implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(call, q, k, v, q_ids, kv_ids):
    return _backend(call).forward(q, k, v, q_ids, kv_ids, spec=call.spec, config=call.config).out


def _attention_fwd(call, q, k, v, q_ids, kv_ids):
    out, lse = _backend(call).forward(q, k, v, q_ids, kv_ids, spec=call.spec, config=call.config)
    # Residuals: the inputs (re-quantized in the backward), O (stale / do_matched deltas)
    # and the log-sum-exp (recomputed P = exp(S - lse)).
    return out, (q, k, v, out, lse, q_ids, kv_ids)


def _attention_bwd(call, residuals, do):
    q, k, v, out, lse, q_ids, kv_ids = residuals
    grads = _backend(call).backward(
        q, k, v, out, lse, do, q_ids, kv_ids, spec=call.spec, config=call.config
    )
    return grads.dq, grads.dk, grads.dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)

# Every call with the same shapes and AttentionConfig shares one traced jaxpr, so its forward,
# its VJP and their kernels are lowered (and compiled) once per program, not once per layer:
# an unscanned model with six attention layers otherwise lowers each Pallas kernel six times.
_shared_attention = jax.jit(_attention, static_argnums=(0,))
# Pallas' GPU interpreter (jax 0.11.2) waits forever when its kernels run inside a jit on a
# 2-core CPU, so a call of it outside any jit stays outside one.
_EAGER_ONLY = frozenset({"mosaic_interpret"})


def _fail(argument, expected, got):
    raise ValueError(f"{argument}: expected {expected}, got {got}")


def _check_arrays(q, k, v):
    """Ranks, dtypes and sizes of q, k, v (ValueError naming the argument)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            shape = getattr(x, "shape", type(x))
            _fail(name, "a rank-4 array [batch, tokens, heads, head_dim]", f"shape {shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            _fail(name, "a floating-point dtype", x.dtype)
    b, _, hq, dqk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        _fail("k, v", f"batch size {b} (from q)", f"k {k.shape}, v {v.shape}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        _fail("v", f"the tokens and heads of k {k.shape[:3]}", f"shape {v.shape}")
    if k.shape[3] != dqk:
        _fail("k", f"head dim {dqk} (q's head dim)", f"head dim {k.shape[3]}")
    if dqk == 0:
        _fail("q", "a head dim of at least 1", "head dim 0")
    if k.shape[2] == 0 or hq % k.shape[2]:
        _fail("k", f"a number of heads dividing q's {hq} heads (GQA/MQA)", f"{k.shape[2]} heads")


def _check_segment_ids(segment_ids, b, t, s):
    """(q_ids, kv_ids) int32 or (None, None), from the accepted forms of ``segment_ids``."""
    if segment_ids is None:
        return None, None
    pair = isinstance(segment_ids, (tuple, list))
    if pair and len(segment_ids) != 2:
        _fail(
            "segment_ids", "an array [B, T] or a (q_ids, kv_ids) pair", f"{len(segment_ids)} items"
        )
    if not pair and t != s:
        _fail(
            "segment_ids", f"a (q_ids [B, {t}], kv_ids [B, {s}]) pair because T != S", "one array"
        )
    raw = segment_ids if pair else (segment_ids,)
    if any(not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer) for ids in raw):
        _fail("segment_ids", "an integer dtype", [jnp.asarray(ids).dtype for ids in raw])
    q_ids, kv_ids = split_segment_ids(segment_ids)
    for name, ids, n in (("q segment_ids", q_ids, t), ("kv segment_ids", kv_ids, s)):
        if tuple(ids.shape) != (b, n):
            _fail(name, f"shape {(b, n)}", f"shape {tuple(ids.shape)}")
    return q_ids, kv_ids


def _check_inputs(q, k, v, delta, precision, scale, segment_ids, implementation):
    """Validate arguments; return (q_segment_ids, kv_segment_ids) as int32 arrays or None."""
    _check_arrays(q, k, v)
    if delta not in numerics.DELTA_MODES:
        _fail("delta", f"one of {numerics.DELTA_MODES}", repr(delta))
    if precision not in numerics.PRECISIONS:
        _fail("precision", f"one of {numerics.PRECISIONS}", repr(precision))
    if implementation is not None and implementation not in backends.IMPLEMENTATIONS:
        _fail("implementation", f"None or one of {backends.IMPLEMENTATIONS}", repr(implementation))
    if scale is not None:
        if isinstance(scale, jax.core.Tracer) or not math.isfinite(float(scale)) or scale <= 0:
            _fail("scale", "a positive finite Python number (static)", repr(scale))
        if scale > MAX_SCALE:
            _fail(
                "scale",
                f"at most {MAX_SCALE:g}: FP8 and bf16 flash attention recompute f32 logits, "
                "which lose the precision softmax needs at larger scales (results turn to NaN)",
                repr(scale),
            )
    return _check_segment_ids(segment_ids, q.shape[0], q.shape[1], k.shape[1])
