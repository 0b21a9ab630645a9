"""Pure-JAX attention references.

* :func:`mha_reference`: high-precision (f32 math) attention, the accuracy oracle.
* :func:`flash_forward` / :func:`flash_backward`: a blockwise emulation of the flash
  algorithm with exactly the numerics of the Pallas kernels (FP8 or bf16 operands, FP32
  softmax and accumulation, P and dS quantized per tile). Block sizes are parameters (the
  tiles of ``pallas_kernels.fp8_attention.tiles.NumericsTiles``) so a kernel can be matched
  tile for tile. ``dm_jax.reference_ops`` registers the emulation as the "reference" backend.

Layouts: public functions take ``[B, T, H, D]``; the emulation works on ``[B, H, T, D]``.
Equations (README.md and docs/numerics.md), per head, with hats for decoded FP8 operands:
    S = scale * Q^ K^^T,   P = softmax(S),   O = P^ V^            (forward)
    dV = P^^T dO^,  dP^ = dO^ V^^T,  dS = P * (dP^ - delta),
    dQ = scale * dS^ K^,   dK = scale * dS^^T Q^                   (backward)
with ``delta`` one of: stale = rowsum(dO * O), do_matched = rowsum(dO^ * O),
matched = sum_j P_ij dP^_ij.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dm_jax import numerics
from dm_jax.masking import MaskInfo, tile_mask
from pallas_kernels.fp8_attention.api import BackwardResult
from pallas_kernels.fp8_attention.numerics import DELTA_MODES
from pallas_kernels.fp8_attention.tiles import ds_scale_axes

_HIGHEST = lax.Precision.HIGHEST


def _dot(a, b, contract):
    """f32 dot of cast operands: exact products, f32 accumulation (no TF32)."""
    return jnp.einsum(contract, numerics.upcast(a), numerics.upcast(b), precision=_HIGHEST)


# --------------------------------------------------------------------------------------
# High-precision attention
# --------------------------------------------------------------------------------------
def attention_probabilities(q, k, *, causal=False, scale=None, segment_ids=None):
    """Softmax probabilities P of high-precision attention, in f32.

    Args:
      q: [B, T, Hq, Dqk]; k: [B, S, Hkv, Dqk]; Hq % Hkv == 0; segment_ids as `mha_reference`.
    Returns:
      [B, Hkv, Hq // Hkv, T, S] float32 (query head h = kv head * group + g). Rows with no
      visible key are 0.
    """
    b, t, hq, dqk = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scale = dqk**-0.5 if scale is None else scale
    group = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, t, hkv, group, dqk)
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32), precision=_HIGHEST)
    logits = logits * scale
    info = MaskInfo.create(t, s, causal=causal, segment_ids=segment_ids)
    valid = tile_mask(info, jnp.arange(t), jnp.arange(s))  # [B or 1, T, S]
    valid = valid[:, None, None]
    logits = jnp.where(valid, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isneginf(row_max), 0.0, row_max)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0, 1.0, denom)


def mha_reference(q, k, v, *, causal=False, scale=None, segment_ids=None):
    """High-precision attention in f32.

    Args:
      q: [B, T, Hq, Dqk]; k: [B, S, Hkv, Dqk]; v: [B, S, Hkv, Dv]; Hq % Hkv == 0.
      segment_ids: None, [B, T] (T == S) or (q_ids [B, T], kv_ids [B, S]).
    Returns:
      [B, T, Hq, Dv] in q's dtype. Rows with no visible key are 0.
    """
    b, t, hq, _ = q.shape
    p = attention_probabilities(q, k, causal=causal, scale=scale, segment_ids=segment_ids)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(b, t, hq, v.shape[-1]).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Blockwise emulation of the kernels
# --------------------------------------------------------------------------------------
class QuantizedOperand(NamedTuple):
    """An operand cast for the dots, as ``[B, H, nblocks, block, D]`` tiles.

    ``inv_scale`` is ``[B, H, nblocks]``: one decode factor per tile (tiles divide the
    128-token scale block, so one tile sees one scale). ``poison`` is ``[B, H, nblocks,
    block]``: NaN for tokens whose row held a NaN or Inf (zeroed in ``values``), else 0.
    """

    values: jax.Array
    inv_scale: jax.Array
    poison: jax.Array


def _pad_tokens(x_BHTD, multiple):
    t = x_BHTD.shape[2]
    pad = -t % multiple
    return jnp.pad(x_BHTD, ((0, 0), (0, 0), (0, pad), (0, 0))), t + pad


def quantize_operand(x_BHTD, block, precision):
    """Cast ``[B, H, T, D]`` per 128-token scale block and cut it into ``block``-token tiles."""
    if numerics.SCALE_BLOCK % block:
        raise ValueError(f"block sizes must divide {numerics.SCALE_BLOCK}, got {block}")
    bad = numerics.nonfinite_tokens(x_BHTD)
    x8, scales = numerics.quantize_tokens(numerics.finite_or_zero(x_BHTD), precision)
    x8, t_pad = _pad_tokens(x8, block)
    b, h, _, d = x8.shape
    n = t_pad // block
    per_tile = numerics.expand_token_scales(scales, t_pad)[..., ::block]  # [B, H, n]
    poison = _pad_tokens(numerics.poison(bad)[..., None], block)[0].reshape(b, h, n, block)
    return QuantizedOperand(x8.reshape(b, h, n, block, d), 1.0 / per_tile, poison)


def _grouped(op: QuantizedOperand, hkv) -> QuantizedOperand:
    """A query-side operand with its heads as [B, Hkv, G, ...]."""
    return QuantizedOperand(*(_group_queries(x, hkv) for x in op))


def _poisoned(op: QuantizedOperand, *poisons) -> QuantizedOperand:
    """``op`` whose per-token poison also carries ``poisons`` (NaN + 0 = NaN: an "or")."""
    return op._replace(poison=sum(poisons, op.poison))


def _to_bhtd(x):
    return jnp.swapaxes(x, 1, 2)


def _group_queries(x_BHnbD, hkv):
    """[B, Hq, ...] -> [B, Hkv, G, ...] (query heads of one kv head side by side)."""
    b, hq = x_BHnbD.shape[:2]
    return x_BHnbD.reshape(b, hkv, hq // hkv, *x_BHnbD.shape[2:])


class _Tiles(NamedTuple):
    """Everything the forward and backward need, cast and cut into tiles.

    Non-finite tokens are zeroed in the values; q's poison marks the query rows (bad Q, and
    in the backward bad dO, lse or delta), k's the keys (bad K or V) whose scores are NaN.
    """

    q: QuantizedOperand  # values [B, Hkv, G, nq, bq, Dqk], inv [B, Hkv, G, nq]
    k: QuantizedOperand  # values [B, Hkv, nk, bk, Dqk], inv [B, Hkv, nk]
    v: QuantizedOperand  # values [B, Hkv, nk, bk, Dv]
    q_pos: jax.Array  # [nq, bq]
    k_pos: jax.Array  # [nk, bk]


def _tile_inputs(q, k, v, block_q, block_k, precision):
    hkv = k.shape[2]
    qo = _grouped(quantize_operand(_to_bhtd(q), block_q, precision), hkv)
    ko = quantize_operand(_to_bhtd(k), block_k, precision)
    vo = quantize_operand(_to_bhtd(v), block_k, precision)
    ko = _poisoned(ko, vo.poison)  # a bad V row poisons its key's scores
    nq, nk = qo.values.shape[3], ko.values.shape[2]
    q_pos = jnp.arange(nq * block_q).reshape(nq, block_q)
    k_pos = jnp.arange(nk * block_k).reshape(nk, block_k)
    return _Tiles(qo, ko, vo, q_pos, k_pos)


def _scores(tiles, j, info, sm_scale):
    """Logits of every query tile against key tile ``j``: [B, Hkv, G, nq, bq, bk].

    S = (Q^ K^^T) * (scale / (s_q s_k)), NaN for poisoned rows and keys; masked entries
    are -inf.
    """
    kj = tiles.k.values[:, :, j]
    raw = _dot(tiles.q.values, kj, "bkgnqd,bkcd->bkgnqc")
    descale = sm_scale * tiles.q.inv_scale * tiles.k.inv_scale[:, :, None, None, j]
    s = raw * descale[..., None, None]
    s = s + tiles.q.poison[..., None] + tiles.k.poison[:, :, None, None, None, j]
    valid = tile_mask(info, tiles.q_pos, tiles.k_pos[j])  # [B or 1, nq, bq, bk]
    return jnp.where(valid[:, None, None], s, -jnp.inf)


def _unmasked_max(m):
    return jnp.where(jnp.isneginf(m), 0.0, m)


@functools.partial(
    jax.jit, static_argnames=("causal", "sm_scale", "precision", "block_q", "block_k")
)
def flash_forward(q, k, v, segment_ids=None, *, causal, sm_scale, precision, block_q, block_k):
    """Blockwise forward with online softmax; ``(out [B, T, Hq, Dv], lse [B, Hq, T])``.

    Per key tile j (FP32 softmax state m, l, acc per query row):
        m' = max(m, rowmax S_j);  p = exp(S_j - m');  alpha = exp(m - m')
        l = alpha l + rowsum(p);  acc = alpha acc + (p * 256)^ V^_j / 256
    out = acc / l (0 for rows with no visible key), lse = m + log l (+inf there).
    """
    b, t, hq, _ = q.shape
    s_len, dv = v.shape[1], v.shape[3]
    tiles = _tile_inputs(q, k, v, block_q, block_k, precision)
    info = MaskInfo.create(t, s_len, causal=causal, segment_ids=segment_ids)
    p_scale = numerics.p_scale(precision)
    rows = tiles.q.values.shape[:-1]  # [B, Hkv, G, nq, bq]

    def step(carry, j):
        m, l, acc = carry
        s = _scores(tiles, j, info, sm_scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = _unmasked_max(m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        p8 = numerics.cast_operand(p, p_scale, precision)
        pv = _dot(p8, tiles.v.values[:, :, j], "bkgnqc,bkcd->bkgnqd")
        pv = pv * (tiles.v.inv_scale[:, :, None, None, j, None, None] / p_scale)
        return (m_new, l, alpha[..., None] * acc + pv), None

    init = (
        jnp.full(rows, -jnp.inf, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros(rows + (dv,), jnp.float32),
    )
    n_k = tiles.k.values.shape[2]
    (m, l, acc), _ = lax.scan(step, init, jnp.arange(n_k))
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, jnp.inf, m + jnp.log(l))
    out = out.reshape(b, hq, -1, dv)[:, :, :t]
    lse = lse.reshape(b, hq, -1)[:, :, :t]
    return jnp.swapaxes(out, 1, 2).astype(q.dtype), lse


def _cast_ds(ds, axes, precision):
    """(dS^, its scales as ds's shape): a power-of-two scale per amax over ``axes``."""
    scale = numerics.tile_scale(ds, precision, axis=axes, keepdims=True)
    scale = jnp.broadcast_to(scale, ds.shape)
    return numerics.cast_operand(ds, scale, precision), scale


def _rowsum_delta(do8_tiles, do, o, delta, hkv, block_q):
    """stale: rowsum(dO * O) (dO before its cast); do_matched: rowsum(dO^ * O)."""
    o_f = _to_bhtd(o).astype(jnp.float32)
    if delta == "stale":
        do_f = _to_bhtd(do).astype(jnp.float32)
    else:
        vals = numerics.upcast(do8_tiles.values) * do8_tiles.inv_scale[..., None, None]
        b, _, g, nq, bq, d = vals.shape
        do_f = vals.reshape(b, hkv * g, nq * bq, d)[:, :, : o_f.shape[2]]
    rows = numerics.row_dot(do_f, o_f)  # [B, Hq, T], the kernels' fixed order
    rows, _ = _pad_tokens(rows[..., None], block_q)
    b, hq = rows.shape[:2]
    return _group_queries(rows[..., 0].reshape(b, hq, -1, block_q), hkv)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "precision", "delta", "block_q", "block_k", "ds_scale"),
)
def flash_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    segment_ids=None,
    *,
    causal,
    sm_scale,
    precision,
    delta,
    block_q,
    block_k,
    ds_scale="rows",
):
    """Blockwise backward with recomputed P; returns :class:`BackwardResult`.

    Pass 1 (``matched`` only): delta_i = sum_j P_ij dP^_ij over all key tiles, with dP^
    computed by the same function (same operands, scales and order) as in pass 2.
    Pass 2, per key tile j: P = exp(S - lse); dP^ = dO^ V^^T; dS = P (dP^ - delta);
    dS^ = cast(dS * s) with ``ds_scale``'s scales (``tiles.DS_SCALES``: "rows", per query
    for dQ and per key for dK; "tile", one per tile for both); dV_j = (P*256)^^T dO^;
    dQ += dS^ K^_j; dK_j = dS^^T Q^. The post-cast statistics read dQ's dS^.
    """
    if delta not in DELTA_MODES:
        raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta!r}")
    b, t, hq, dqk = q.shape
    s_len, hkv, dv_dim = v.shape[1], v.shape[2], v.shape[3]
    tiles = _tile_inputs(q, k, v, block_q, block_k, precision)
    do8 = _grouped(quantize_operand(_to_bhtd(do), block_q, precision), hkv)
    info = MaskInfo.create(t, s_len, causal=causal, segment_ids=segment_ids)
    lse_t, _ = _pad_tokens(lse[..., None], block_q)
    lse_t = _group_queries(lse_t[..., 0].reshape(b, hq, -1, block_q), hkv)
    # rows with a bad dO or a NaN lse (they saw a bad token) get NaN scores instead
    rows_bad = numerics.poison(jnp.isnan(lse_t))
    tiles = tiles._replace(q=_poisoned(tiles.q, do8.poison, rows_bad))
    lse_t = jnp.where(jnp.isnan(lse_t), 0.0, lse_t)  # +inf (rows that see nothing) stays
    p_scale = numerics.p_scale(precision)
    ds_axes = ds_scale_axes(ds_scale)

    def probs(j, tiles):
        s = _scores(tiles, j, info, sm_scale)
        return jnp.exp(s - lse_t[..., None])  # 0 where masked (S = -inf)

    def dp_hat(j):
        raw = _dot(do8.values, tiles.v.values[:, :, j], "bkgnqd,bkcd->bkgnqc")
        descale = do8.inv_scale * tiles.v.inv_scale[:, :, None, None, j]
        return raw * descale[..., None, None]

    n_k = tiles.k.values.shape[2]
    if delta == "matched":

        def delta_step(acc, j):
            # the fixed order of the kernels' CPU twin: bitwise the same delta
            return acc + numerics.row_dot(probs(j, tiles), dp_hat(j)), None

        delta_t, _ = lax.scan(delta_step, jnp.zeros(lse_t.shape, jnp.float32), jnp.arange(n_k))
    else:
        delta_t = _rowsum_delta(do8, do, o, delta, hkv, block_q)
    # a non-finite delta poisons its row's scores rather than meeting masked pairs
    tiles_ds = tiles._replace(q=_poisoned(tiles.q, numerics.poison(~jnp.isfinite(delta_t))))
    delta_ds = numerics.finite_or_zero(delta_t)

    def step(carry, j):
        dq, stats = carry
        p = probs(j, tiles_ds)
        ds = p * (dp_hat(j) - delta_ds[..., None])  # [B, Hkv, G, nq, bq, bk]
        # dS^ for dQ (scales per query, or per tile) and for dK (per key, or per tile)
        (ds8_q, scale_q), (ds8_k, scale_k) = (_cast_ds(ds, axes, precision) for axes in ds_axes)
        ds_post = numerics.upcast(ds8_q) / scale_q
        stats = (
            stats[0] + jnp.sum(ds, -1),
            stats[1] + jnp.sum(jnp.abs(ds), -1),
            stats[2] + jnp.sum(ds_post, -1),
            stats[3] + jnp.sum(jnp.abs(ds_post), -1),
        )
        descale_q = sm_scale / scale_q[..., :1]  # [B, Hkv, G, nq, bq, 1]: per query row
        descale_k = sm_scale / jnp.swapaxes(scale_k[..., :1, :], -1, -2)  # [.., bk, 1]: per key
        kj = tiles.k.values[:, :, j]
        dq = dq + _dot(ds8_q, kj, "bkgnqc,bkcd->bkgnqd") * (
            descale_q * tiles.k.inv_scale[:, :, None, None, j, None, None]
        )
        dk_j = _dot(ds8_k, tiles.q.values, "bkgnqc,bkgnqd->bkgncd") * (
            descale_k * tiles.q.inv_scale[..., None, None]
        )
        p8 = numerics.cast_operand(p, p_scale, precision)
        dv_j = (
            _dot(p8, do8.values, "bkgnqc,bkgnqd->bkgncd")
            * (do8.inv_scale / p_scale)[..., None, None]
        )
        # dK_j, dV_j: sum over query tiles and over the query heads of the group.
        return (dq, stats), (jnp.sum(dk_j, (2, 3)), jnp.sum(dv_j, (2, 3)))

    zeros_rows = jnp.zeros(lse_t.shape, jnp.float32)
    init = (jnp.zeros(tiles.q.values.shape, jnp.float32), (zeros_rows,) * 4)
    (dq, stats), (dk, dv) = lax.scan(step, init, jnp.arange(n_k))

    def rows_out(x):  # [B, Hkv, G, nq, bq] -> [B, Hq, T]
        return x.reshape(b, hq, -1)[:, :, :t]

    dq = jnp.swapaxes(dq.reshape(b, hq, -1, dqk)[:, :, :t], 1, 2)
    # scan stacks key tiles first: [nk, B, Hkv, bk, D] -> [B, Hkv, S, D]
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, hkv, -1, dqk)[:, :, :s_len]
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, hkv, -1, dv_dim)[:, :, :s_len]
    return BackwardResult(
        dq.astype(q.dtype),
        jnp.swapaxes(dk, 1, 2).astype(k.dtype),
        jnp.swapaxes(dv, 1, 2).astype(v.dtype),
        rows_out(delta_t),
        *(rows_out(x) for x in stats),
    )
