"""cuDNN attention arms for comparison: bf16 and FP8 flash attention through JAX's cuDNN
bindings. Layout [B, T, H, D] like `dm_jax.attention`; GQA by repeating k/v heads.

cudnn_fp8_attention: scaling recipe
-----------------------------------
cuDNN's FP8 attention takes FP8 q, k, v (and dO in backward) plus *descale* factors that
turn them back into real values, and *scale* factors for the tensors it writes in FP8:
the probabilities S (= P), the output O, the softmax-gradient dP (really dS), and the
gradients dQ, dK, dV. It also returns the amax of what it wrote.

Here every input is scaled with its *current* amax (the same rule as the rest of dm_jax:
s = 2^floor(log2(448 / amax)), one scale per tensor): q, k, v in the forward, dO in the
backward. The JAX binding fixes all scale factors when the forward runs, before dO exists,
so dO is pre-scaled by its own current scale and handed over with descale 1; the backward
is linear in dO, so the gradients are divided by that scale afterwards. Of the tensors
cuDNN *writes* in FP8, P and O have exact bounds:
  P <= 1                  -> scale_s = 256
  |O| <= amax(v)          -> scale_o = s_v
dS, dQ, dK and dV have none that is useful (worst cases grow with the sequence length and
leave most of the gradient below the FP8 range), so the backward runs twice. The first
pass writes dS with a Cauchy-Schwarz bound (|dP_ij| <= ||dO_i|| ||v_j||, |dS| <= 2 max|dP|)
and dQ, dK, dV with scale 1, and only its amax reports are kept: with scale 1 they are
amax values of the real gradients whichever side of the scaling cuDNN measures them on.
The second pass reruns forward and backward with every scale from those *current* amax
values (2 x amax for dS, which also holds delta, and for dQ, dK, whose first-pass amax
comes from the bound-scaled dS and may read low). Every FP8 tensor is thus scaled from its own current amax,
at the price of one extra forward and backward of the attention core per training step;
time the forward, or read this arm's backward timings as an upper bound.

How this differs from Transformer Engine: TE uses *delayed* scaling. Each FP8 tensor's
scale comes from a rolling history of amax values from previous steps (default: the max
over a window of 1024 steps), including the amax values cuDNN returns for S, O, dP, dQ,
dK, dV. Scales therefore lag the data: a tensor whose range grows between steps saturates
at +-448 until the history catches up, and history resets (new data, restarts) shift every
scale at once. Current scaling has no state and never saturates its inputs; its cost is an
extra amax reduction per input tensor and, here, the second backward pass.

Constraints (cuDNN FP8 training kernels): head dim 128 for q, k and v, T and S multiples
of 128, no segment ids; a GPU with cuDNN. Anything else raises before reaching cuDNN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dm_jax.masking import split_segment_ids
from dm_jax.nn.fp8 import FP8_MAX, current_scale, quantize


def _require_gpu(name: str):
  if jax.default_backend() != "gpu":
    raise RuntimeError(f"{name} needs a CUDA GPU with cuDNN; the default backend is "
                       f"{jax.default_backend()!r}. Use the 'reference' or 'bf16' arm instead.")


def _repeat_kv(q, k, v):
  Hq, Hkv = q.shape[2], k.shape[2]
  if Hq % Hkv:
    raise ValueError(f"k: {Hkv} kv heads must divide the {Hq} query heads")
  return jnp.repeat(k, Hq // Hkv, axis=2), jnp.repeat(v, Hq // Hkv, axis=2)


def _segment_mask(segment_ids, T, S):
  """[B, 1, T, S] bool mask from int segment ids [B, T] or (q_ids [B, T], kv_ids [B, S])."""
  q_ids, kv_ids = split_segment_ids(segment_ids)
  if q_ids.shape[1] != T or kv_ids.shape[1] != S:
    raise ValueError(f"segment_ids: expected [B, {T}] and [B, {S}], got {q_ids.shape}, "
                     f"{kv_ids.shape}")
  return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def cudnn_bf16_attention(q, k, v, *, causal=False, scale=None, segment_ids=None):
  """cuDNN flash attention in bf16: q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,Dv] bf16."""
  _require_gpu("cudnn_bf16_attention")
  mask = None if segment_ids is None else _segment_mask(segment_ids, q.shape[1], k.shape[1])
  bf = lambda x: x.astype(jnp.bfloat16)
  out = jax.nn.dot_product_attention(bf(q), bf(k), bf(v), mask=mask, scale=scale,
                                     is_causal=causal, implementation="cudnn")
  return out.astype(q.dtype)


def check_cudnn_fp8_shapes(q, k, v, segment_ids=None):
  """Raises NotImplementedError unless cuDNN's FP8 training kernel supports the shapes."""
  T, S = q.shape[1], k.shape[1]
  dims = (q.shape[-1], k.shape[-1], v.shape[-1])
  if segment_ids is not None:
    raise NotImplementedError("cudnn_fp8_attention: segment_ids are not supported by "
                              "cuDNN FP8 attention; use the dm_jax arms for packed data")
  if dims != (128, 128, 128) or T % 128 or S % 128:
    raise NotImplementedError(
        f"cudnn_fp8_attention supports head dim 128 and T, S multiples of 128; got head "
        f"dims (q, k, v) = {dims}, T = {T}, S = {S}")


def cudnn_fp8_attention(q, k, v, *, causal=False, scale=None, segment_ids=None,
                        unverified_gradients=False):
  """cuDNN FP8 flash attention with current per-tensor scaling (module docstring).

  q [B, T, Hq, 128], k/v [B, S, Hkv, 128] -> [B, T, Hq, 128] in q's dtype.

  Gradients: on the H200 (jax 0.11.2, cuDNN 9.19) the backward recipe below returned
  wrong dQ/dK/dV (relative error ~1.0; docs/benchmarks.md, "cuDNN FP8 backward"), so
  differentiating raises unless ``unverified_gradients=True`` (for timing and probing).
  """
  check_cudnn_fp8_shapes(q, k, v, segment_ids)
  _require_gpu("cudnn_fp8_attention")
  k, v = _repeat_kv(q, k, v)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  return _cudnn_fp8(q, k, v, scale, bool(causal), bool(unverified_gradients))


def _fp8_params(sq, sk, sv, v):
  """Scale/descale factors ((1,1,1,1) float32 each) for the cuDNN FP8 kernels; the
  backward's output scales are the first-pass values (see the module docstring)."""
  vnorm = jnp.max(jnp.linalg.norm(v.astype(jnp.float32), axis=-1))
  bound_dp = FP8_MAX * v.shape[-1] ** 0.5 * vnorm  # max ||dO^_i|| max ||v_j||
  s_dp = current_scale(2 * bound_dp)
  one = jnp.float32(1.0)
  vals = {"descale_q": 1 / sq, "descale_k": 1 / sk, "descale_v": 1 / sv,
          "scale_s": jnp.float32(256.0), "descale_s": jnp.float32(1 / 256.0),
          "scale_o": sv, "descale_o": 1 / sv, "descale_dO": one,
          "scale_dP": s_dp, "descale_dP": 1 / s_dp,
          "scale_dQ": one, "scale_dK": one, "scale_dV": one,
          "amax_dQ": one, "amax_dK": one, "amax_dV": one, "amax_dP": one}
  return {name: jnp.reshape(x, (1, 1, 1, 1)).astype(jnp.float32) for name, x in vals.items()}


def _run_fp8(q8, k8, v8, params, scale, causal):
  """One cuDNN FP8 call: (o8, amax_s, amax_o) and its VJP over (q8, k8, v8, params)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
  run = lambda q8, k8, v8, params: fa.dot_product_attention(
      q8, k8, v8, fp8_params=params, scale=scale, mask_type=mask_type, qkv_layout="BTNH",
      use_fp8=True)
  return jax.vjp(run, q8, k8, v8, params)


def _fp8_grads(vjp, out, do8):
  """(dq8, dk8, dv8, amax per gradient name) from a cuDNN FP8 backward."""
  _, amax_s, amax_o = out
  dq8, dk8, dv8, dparams = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
  return dq8, dk8, dv8, {k: dparams[k] for k in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _cudnn_fp8(q, k, v, scale, causal, unverified_gradients):
  return _cudnn_fp8_fwd(q, k, v, scale, causal, unverified_gradients)[0]


def _cudnn_fp8_fwd(q, k, v, scale, causal, unverified_gradients):
  del unverified_gradients
  sq, sk, sv = current_scale(q), current_scale(k), current_scale(v)
  params = _fp8_params(sq, sk, sv, v)
  q8, k8, v8 = quantize(q, sq), quantize(k, sk), quantize(v, sv)
  out, vjp = _run_fp8(q8, k8, v8, params, scale, causal)
  o = (out[0].astype(jnp.float32) / params["scale_o"].reshape(())).astype(q.dtype)
  like = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v))  # dtypes, as arrays
  return o, (vjp, out, (q8, k8, v8), params, like)


def _cudnn_fp8_bwd(scale, causal, unverified_gradients, res, do):
  """Two passes: the first (dS scale from a bound, dQ/dK/dV at scale 1) measures the amax of
  dP, dQ, dK, dV; the second reruns forward and backward with scales from those amax."""
  if not unverified_gradients:
    raise NotImplementedError(
        "cudnn_fp8_attention: its gradients were wrong on the H200 (relative error ~1.0, "
        "docs/benchmarks.md 'cuDNN FP8 backward'); training with this arm is disabled. "
        "Pass unverified_gradients=True to time or probe the backward anyway.")
  vjp, out, qkv8, params, like = res
  s_do = current_scale(do)
  do8 = quantize(do, s_do)
  *_, amax = _fp8_grads(vjp, out, do8)
  exact = {"scale_dP": current_scale(2 * amax["amax_dP"]),
           "scale_dQ": current_scale(2 * amax["amax_dQ"]),
           "scale_dK": current_scale(2 * amax["amax_dK"]),
           "scale_dV": current_scale(amax["amax_dV"])}
  exact["descale_dP"] = 1 / exact["scale_dP"]
  params = {**params, **{k: v.reshape(1, 1, 1, 1) for k, v in exact.items()}}
  out, vjp = _run_fp8(*qkv8, params, scale, causal)
  grads8 = _fp8_grads(vjp, out, do8)[:3]
  names = ("scale_dQ", "scale_dK", "scale_dV")
  return tuple((g8.astype(jnp.float32) / (params[n].reshape(()) * s_do)).astype(x.dtype)
               for g8, n, x in zip(grads8, names, like))


_cudnn_fp8.defvjp(_cudnn_fp8_fwd, _cudnn_fp8_bwd)
