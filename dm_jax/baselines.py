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
dS, dQ, dK and dV have no useful bound (worst cases grow with the sequence length and
would leave most of the gradient below E4M3's smallest subnormal, 2^-9, where it flushes
to zero). cuDNN reports each amax *before* its FP8 cast, so the backward runs three
times, each pass fixing the scales the next one needs:
  1. all output scales 1: the amax of dS and of dV (dV does not depend on dS).
  2. dS and dV scaled from pass 1: dS is now in range, so the amax of dQ and dK are true.
  3. dQ and dK scaled from pass 2 (one scale for both): the gradients.
Three measured quirks of the binding (H200, jax 0.11.2, cuDNN 9.19; docs/benchmarks.md,
"cuDNN FP8 backward") are handled in `_fp8_params` and `backward_scales`: the output
scale keys are rotated (scale_dQ scales dS, scale_dK dQ, scale_dV dK, scale_dP dV), the
descale_o and descale_dO keys are swapped, and dS comes out descale_s (1/scale_s) times
its true value. The JAX binding takes the backward's scales when the forward runs, so
each pass reruns the forward on the same FP8 inputs (XLA merges identical calls in one
jit). Every FP8 tensor is scaled from its own current amax, at the price of three cuDNN
backward passes per step: time the forward, or read this arm's backward timings as an
upper bound.

How this differs from Transformer Engine: TE uses *delayed* scaling. Each FP8 tensor's
scale comes from a rolling history of amax values from previous steps (default: the max
over a window of 1024 steps), including the amax values cuDNN returns for S, O, dP, dQ,
dK, dV. Scales therefore lag the data: a tensor whose range grows between steps saturates
at +-448 until the history catches up, and history resets (new data, restarts) shift every
scale at once. Current scaling has no state and never saturates its inputs; its cost is an
extra amax reduction per input tensor and, here, the extra backward passes.

Constraints (cuDNN FP8 training kernels): head dim 128 for q, k and v, T and S multiples
of 128, no segment ids; a GPU with cuDNN. Anything else raises before reaching cuDNN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dm_jax.masking import split_segment_ids
from dm_jax.nn.sequence import document_starts
from dm_jax.nn.fp8 import current_scale, quantize


def _require_gpu(name: str):
    if jax.default_backend() != "gpu":
        raise RuntimeError(
            f"{name} needs a CUDA GPU with cuDNN; the default backend is "
            f"{jax.default_backend()!r}. Use the 'reference' or 'bf16' arm instead."
        )


def _repeat_kv(q, k, v):
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"k: {Hkv} kv heads must divide the {Hq} query heads")
    return jnp.repeat(k, Hq // Hkv, axis=2), jnp.repeat(v, Hq // Hkv, axis=2)


def _segment_mask(segment_ids, T, S):
    """[B, 1, T, S] bool mask from int segment ids [B, T] or (q_ids [B, T], kv_ids [B, S])."""
    q_ids, kv_ids = split_segment_ids(segment_ids)
    if q_ids.shape[1] != T or kv_ids.shape[1] != S:
        raise ValueError(
            f"segment_ids: expected [B, {T}] and [B, {S}], got {q_ids.shape}, {kv_ids.shape}"
        )
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def cudnn_bf16_attention(q, k, v, *, causal=False, scale=None, segment_ids=None, max_segments=None):
    """cuDNN flash attention in bf16: q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,Dv] bf16.

    Segment ids go to cuDNN as a dense [B, 1, T, S] mask (a constant bias it reads in both
    directions) unless ``max_segments`` is given: then self-attention segment ids (one [B, T]
    array of contiguous runs) go as cuDNN's packed sequences (`packed_segments`: each
    document's start and length), which need at most ``max_segments`` documents per row
    (a row with more: the first ``max_segments`` are attended, the rest see nothing).
    """
    packed = segment_ids is not None and max_segments is not None
    if packed and (isinstance(segment_ids, (tuple, list)) or q.shape[1] != k.shape[1]):
        raise ValueError(
            "max_segments: cuDNN's packed sequences take self-attention segment ids (one [B, T] "
            f"array with T = S), got {type(segment_ids).__name__} for T = {q.shape[1]}, "
            f"S = {k.shape[1]}"
        )
    _require_gpu("cudnn_bf16_attention")
    bf = lambda x: x.astype(jnp.bfloat16)
    if packed:
        return _cudnn_packed(bf(q), bf(k), bf(v), causal, scale, segment_ids, max_segments)
    mask = None if segment_ids is None else _segment_mask(segment_ids, q.shape[1], k.shape[1])
    out = jax.nn.dot_product_attention(
        bf(q), bf(k), bf(v), mask=mask, scale=scale, is_causal=causal, implementation="cudnn"
    )
    return out.astype(q.dtype)


# Documents per row up to which `cudnn_bf16_documents` takes cuDNN's packed sequences; a
# batch with a row of more runs the dense mask (the built-in data holds at most 3 per row
# at 2,048-8,192 tokens)
PACKED_MAX_DOCUMENTS = 16
DOCUMENT_MODES = ("mask", "packed")


def check_documents(mode: str, name: str = "documents") -> str:
    """`mode` if it is one of `DOCUMENT_MODES`, else ValueError naming `name`."""
    if mode not in DOCUMENT_MODES:
        raise ValueError(f"{name}: must be one of {DOCUMENT_MODES}, got {mode!r}")
    return mode


def cudnn_bf16_documents(
    q, k, v, *, causal=False, scale=None, segment_ids, max_segments=PACKED_MAX_DOCUMENTS
):
    """`cudnn_bf16_attention` with self-attention segment ids [B, T] as cuDNN's packed
    sequences when no row holds more than `max_segments` documents, else (decided at run
    time, `lax.cond`) as the dense mask."""
    ids = jnp.asarray(segment_ids, jnp.int32)
    most = jnp.max(jnp.sum(document_starts(ids), axis=1))
    kw = dict(causal=causal, scale=scale, segment_ids=ids)
    return jax.lax.cond(
        most <= max_segments,
        lambda: cudnn_bf16_attention(q, k, v, **kw, max_segments=max_segments),
        lambda: cudnn_bf16_attention(q, k, v, **kw),
    )


def packed_segments(segment_ids, max_segments: int):
    """(seqlen [B, M], offsets [B, M + 1]) int32 of the documents in each row of
    `segment_ids` [B, T] (contiguous runs, `dm_jax.nn.sequence.document_starts`), in the
    form cuDNN's packed attention takes: each document's length and first token, -1 past a
    row's last document (M = `max_segments`; a row's documents past M are dropped)."""
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids: expected one [B, T] array, got shape {segment_ids.shape}")
    if max_segments < 1:
        raise ValueError(f"max_segments: expected >= 1, got {max_segments}")
    t = segment_ids.shape[1]
    starts = document_starts(segment_ids)

    def row(s):  # first tokens of the row's documents, T where there are no more
        return jnp.nonzero(s, size=max_segments + 1, fill_value=t)[0].astype(jnp.int32)

    first = jax.vmap(row)(starts)  # [B, M + 1]
    present = first[:, :-1] < t
    seqlen = jnp.where(present, first[:, 1:] - first[:, :-1], -1)
    offsets = jnp.where(first < t, first, -1).at[:, -1].set(-1)
    return seqlen, offsets


def _cudnn_packed(q, k, v, causal, scale, segment_ids, max_segments):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    seqlen, offsets = packed_segments(jnp.asarray(segment_ids, jnp.int32), max_segments)
    mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return fa.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=seqlen,
        kv_seqlen=seqlen,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=scale,
        mask_type=mask_type,
    )


def check_cudnn_fp8_shapes(q, k, v, segment_ids=None):
    """Raises NotImplementedError unless cuDNN's FP8 training kernel supports the shapes."""
    T, S = q.shape[1], k.shape[1]
    dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    if segment_ids is not None:
        raise NotImplementedError(
            "cudnn_fp8_attention: segment_ids are not supported by "
            "cuDNN FP8 attention; use the dm_jax arms for packed data"
        )
    if dims != (128, 128, 128) or T % 128 or S % 128:
        raise NotImplementedError(
            f"cudnn_fp8_attention supports head dim 128 and T, S multiples of 128; got head "
            f"dims (q, k, v) = {dims}, T = {T}, S = {S}"
        )


def cudnn_fp8_attention(q, k, v, *, causal=False, scale=None, segment_ids=None):
    """cuDNN FP8 flash attention with current per-tensor scaling (module docstring).

    q [B, T, Hq, 128], k/v [B, S, Hkv, 128] -> [B, T, Hq, 128] in q's dtype.
    """
    check_cudnn_fp8_shapes(q, k, v, segment_ids)
    _require_gpu("cudnn_fp8_attention")
    k, v = _repeat_kv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _cudnn_fp8(q, k, v, scale, bool(causal))


def _fp8_params(sq, sk, sv):
    """Scale/descale factors ((1,1,1,1) float32 each) for the cuDNN FP8 kernels. The
    backward's dS and gradient scales start at 1; `_cudnn_fp8_bwd` sets them."""
    one = jnp.float32(1.0)
    vals = {
        "descale_q": 1 / sq,
        "descale_k": 1 / sk,
        "descale_v": 1 / sv,
        "scale_s": jnp.float32(256.0),
        "descale_s": jnp.float32(1 / 256.0),
        "scale_o": sv,
        # measured: the binding's "descale_dO" descales O (in delta) and "descale_o" dO
        # (in dV); dO arrives pre-scaled (descale 1), O in FP8 with scale s_v
        "descale_o": one,
        "descale_dO": 1 / sv,
        "scale_dP": one,
        "descale_dP": one,
        "scale_dQ": one,
        "scale_dK": one,
        "scale_dV": one,
        "amax_dQ": one,
        "amax_dK": one,
        "amax_dV": one,
        "amax_dP": one,
    }
    return {name: _param(x) for name, x in vals.items()}


def _param(x):
    return jnp.reshape(x, (1, 1, 1, 1)).astype(jnp.float32)


def _run_fp8(q8, k8, v8, params, scale, causal):
    """One cuDNN FP8 call: (o8, amax_s, amax_o) and its VJP over (q8, k8, v8, params)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    run = lambda q8, k8, v8, params: fa.dot_product_attention(
        q8,
        k8,
        v8,
        fp8_params=params,
        scale=scale,
        mask_type=mask_type,
        qkv_layout="BTNH",
        use_fp8=True,
    )
    return jax.vjp(run, q8, k8, v8, params)


def fp8_backward(qkv8, params, do8, scale, causal):
    """(dq8, dk8, dv8, amax per gradient name) of one cuDNN FP8 backward with ``params``.

    The forward is rerun with the same inputs and forward scales (XLA merges the identical
    forward calls within one jit)."""
    out, vjp = _run_fp8(*qkv8, params, scale, causal)
    _, amax_s, amax_o = out
    dq8, dk8, dv8, dparams = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
    amax = {k: dparams[k].reshape(()) for k in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")}
    return dq8, dk8, dv8, amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cudnn_fp8(q, k, v, scale, causal):
    return _cudnn_fp8_fwd(q, k, v, scale, causal)[0]


def _cudnn_fp8_fwd(q, k, v, scale, causal):
    sq, sk, sv = current_scale(q), current_scale(k), current_scale(v)
    params = _fp8_params(sq, sk, sv)
    q8, k8, v8 = quantize(q, sq), quantize(k, sk), quantize(v, sv)
    out, _ = _run_fp8(q8, k8, v8, params, scale, causal)
    o = (out[0].astype(jnp.float32) / sv).astype(q.dtype)
    like = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v))  # dtypes, as arrays
    return o, ((q8, k8, v8), params, like)


# What each backward scale key of the JAX binding controls, measured on the H200 (jax
# 0.11.2, cuDNN 9.19; benchmarks/cudnn_fp8_probe.py, docs/benchmarks.md "cuDNN FP8
# backward"): the four output scales arrive rotated by one place.
SCALE_KEY_OF = {"dS": "scale_dQ", "dQ": "scale_dK", "dK": "scale_dV", "dV": "scale_dP"}


def backward_scales(s_ds, s_dqk, s_dv, scale_s):
    """Backward params giving dS, dQ/dK and dV the scales s_ds, s_dqk, s_dv.

    cuDNN's dS (and its reported amax_dP) comes out 1/scale_s of the true dS; the dS descale
    puts that factor back, so dQ and dK come out in true units."""
    return {
        SCALE_KEY_OF["dS"]: _param(s_ds),
        "descale_dP": _param(scale_s / s_ds),
        SCALE_KEY_OF["dQ"]: _param(s_dqk),
        SCALE_KEY_OF["dK"]: _param(s_dqk),
        SCALE_KEY_OF["dV"]: _param(s_dv),
    }


def _cudnn_fp8_bwd(scale, causal, res, do):
    """Three cuDNN backward passes, each scale from the current amax (module docstring)."""
    qkv8, params, like = res
    s_do = current_scale(do)
    do8 = quantize(do, s_do)
    scale_s = params["scale_s"].reshape(())
    one = jnp.float32(1.0)
    # 1. amax of dS and of dV (dV does not depend on dS)
    *_, amax1 = fp8_backward(
        qkv8, {**params, **backward_scales(one, one, one, scale_s)}, do8, scale, causal
    )
    s_ds, s_dv = current_scale(amax1["amax_dP"]), current_scale(amax1["amax_dV"])
    # 2. with dS in range, the amax of dQ and dK (one scale for both: robust to which
    #    amax report is which)
    *_, amax2 = fp8_backward(
        qkv8, {**params, **backward_scales(s_ds, one, s_dv, scale_s)}, do8, scale, causal
    )
    s_dqk = current_scale(jnp.maximum(amax2["amax_dQ"], amax2["amax_dK"]))
    # 3. the gradients
    dq8, dk8, dv8, _ = fp8_backward(
        qkv8, {**params, **backward_scales(s_ds, s_dqk, s_dv, scale_s)}, do8, scale, causal
    )
    return tuple(
        (g8.astype(jnp.float32) / (s * s_do)).astype(x.dtype)
        for g8, s, x in zip((dq8, dk8, dv8), (s_dqk, s_dqk, s_dv), like)
    )


_cudnn_fp8.defvjp(_cudnn_fp8_fwd, _cudnn_fp8_bwd)
