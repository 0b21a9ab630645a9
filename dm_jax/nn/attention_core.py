"""The attention core of every attention layer: one function per experimental arm, and an
adapter with the signature of `jax.nn.dot_product_attention` for existing Flax code.

Arms (the `attention=` switch of a model config):

  reference    high-precision XLA attention (`dm_jax.reference.mha_reference`, FP32 math):
               the paper's BF16/FP32 reference
  bf16         our flash path with bf16 operands (`dm_jax.attention(precision="bf16")`), with
               the conventional delta = rowsum(dO * O) of every flash kernel
  matched      `dm_jax.attention(delta="matched")`: Delta-Matching, delta_i = sum_j P_ij dP^_ij
  do_matched   `dm_jax.attention(delta="do_matched")`: delta_i = <dO^_i, O_i>
  stale        `dm_jax.attention(delta="stale")`: delta_i = <dO_i, O_i> (FP8 operands elsewhere)
  cudnn_fp8    cuDNN's FP8 flash attention with current per-tensor scales (`dm_jax.baselines`)
  cudnn_bf16   cuDNN's bf16 flash attention (`dm_jax.baselines`)

Layout everywhere: q [B, T, Hq, Dqk], k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv] -> [B, T, Hq, Dv].
"""

from __future__ import annotations

import importlib

import jax

ARMS = ("reference", "bf16", "matched", "do_matched", "stale", "cudnn_fp8", "cudnn_bf16")
DELTA_ARMS = ("matched", "do_matched", "stale")
FP8_ARMS = DELTA_ARMS + ("cudnn_fp8",)
# Core precision each arm runs at unless the `attn_core` scope says otherwise.
DEFAULT_CORE_PRECISION = {"reference": "f32", "bf16": "bf16", "matched": "fp8",
                          "do_matched": "fp8", "stale": "fp8", "cudnn_fp8": "fp8",
                          "cudnn_bf16": "bf16"}


def _dm_attention():
  """`dm_jax.attention` (the public op), looked up at call time."""
  pkg = importlib.import_module("dm_jax")
  fn = getattr(pkg, "attention", None)
  if not callable(fn):
    fn = importlib.import_module("dm_jax.attention").attention
  return fn


def _reference(q, k, v, *, causal, scale, segment_ids, implementation, precision):
  del implementation, precision
  from dm_jax.reference import mha_reference
  out = mha_reference(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
  return out.astype(q.dtype)


def _flash(delta):
  def run(q, k, v, *, causal, scale, segment_ids, implementation, precision):
    return _dm_attention()(q, k, v, causal=causal, delta=delta, precision=precision,
                           scale=scale, segment_ids=segment_ids,
                           implementation=implementation)
  return run


def _cudnn(name):
  def run(q, k, v, *, causal, scale, segment_ids, implementation, precision):
    del implementation, precision
    from dm_jax import baselines
    return getattr(baselines, name)(q, k, v, causal=causal, scale=scale,
                                    segment_ids=segment_ids)
  return run


_CORES = {
    "reference": _reference,
    "bf16": _flash("stale"),
    "matched": _flash("matched"),
    "do_matched": _flash("do_matched"),
    "stale": _flash("stale"),
    "cudnn_fp8": _cudnn("cudnn_fp8_attention"),
    "cudnn_bf16": _cudnn("cudnn_bf16_attention"),
}
# Which core precisions each arm can run at ("fp8"/"bf16" go to dm_jax.attention).
_PRECISIONS = {"reference": ("f32",), "bf16": ("bf16",), "matched": ("fp8", "bf16"),
               "do_matched": ("fp8", "bf16"), "stale": ("fp8", "bf16"),
               "cudnn_fp8": ("fp8",), "cudnn_bf16": ("bf16",)}


def check_arm(arm: str, precision: str | None = None) -> str:
  """Validates (arm, core precision); returns the precision the core runs at."""
  if arm not in _CORES:
    raise ValueError(f"attention: must be one of {ARMS}, got {arm!r}")
  precision = precision or DEFAULT_CORE_PRECISION[arm]
  if precision not in _PRECISIONS[arm]:
    raise ValueError(f"attn_core: arm {arm!r} runs at {_PRECISIONS[arm]}, got {precision!r}")
  return precision


def attention_core(q_BTHD, k_BSKD, v_BSKV, *, arm: str = "matched", causal: bool = True,
                   scale: float | None = None, segment_ids=None, implementation=None,
                   precision: str | None = None) -> jax.Array:
  """Runs the attention core of arm `arm`; returns o_BTHV in q's dtype."""
  precision = check_arm(arm, precision)
  return _CORES[arm](q_BTHD, k_BSKD, v_BSKV, causal=causal, scale=scale,
                     segment_ids=segment_ids, implementation=implementation,
                     precision=precision)


# Keywords `flax.nnx.MultiHeadAttention` passes to its attention_fn besides q, k, v and mask.
_FLAX_KWARGS = ("dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic", "dtype", "module")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, arm: str = "matched", segment_ids=None,
                          attn_implementation=None, precision=None, **flax_kwargs):
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
    raise TypeError(f"dot_product_attention: unexpected keyword arguments {unknown}; causality "
                    f"is is_causal=True, the attention backend attn_implementation=")
  unsupported = {"bias": bias, "mask": mask, "query_seq_lengths": query_seq_lengths,
                 "key_value_seq_lengths": key_value_seq_lengths,
                 "local_window_size": local_window_size, "implementation": implementation}
  for name, val in unsupported.items():
    if val is not None:
      raise ValueError(f"{name}: not supported by dm_jax attention (use is_causal=True or "
                       f"segment_ids); got a value")
  del precision  # flax passes its lax.Precision for einsums; the arm sets our precision
  if flax_kwargs.get("dropout_rate", 0.0) and not flax_kwargs.get("deterministic", True):
    raise ValueError("dropout_rate: attention dropout is not supported, set it to 0")
  dtype = flax_kwargs.get("dtype") or query.dtype
  out = attention_core(query, key, value, arm=arm, causal=is_causal, scale=scale,
                       segment_ids=segment_ids, implementation=attn_implementation)
  return out.astype(dtype)
