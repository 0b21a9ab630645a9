"""The Mosaic GPU backward from the public layout: quantize, delta, dQ, dK/dV, unpad.

Runs where :func:`reason` returns None (head dims up to 256, the dS scale tiles of
:func:`ds_tiles`);
``ops.py`` sends every other call to the Triton passes. Head dims over 128 run as
``MosaicConfig.backward_wide_launches`` says: ``"per_chunk"``, the dQ and the dK/dV passes
once per chunk of at most 128 accumulator columns (:func:`.backward.column_chunks`), each
launch recomputing S and dP^ in full; ``"per_gradient"``, one dQ launch, one dV launch and
one dK launch, each over all its columns (:func:`.backward.key_pass_launches`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.api import AttentionSpec, BackwardResult
from pallas_kernels.fp8_attention.mosaic_gpu import backward as kernels
from pallas_kernels.fp8_attention.mosaic_gpu import documents, quantize_kernel
from pallas_kernels.fp8_attention.mosaic_gpu.forward import ForwardMask, kernel_dtype, poison_flags
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import (
    BLOCK,
    MosaicOperand,
    pad_segment_ids,
)
from pallas_kernels.fp8_attention.triton import delta as delta_kernels
from pallas_kernels.fp8_attention.triton.quantize import QuantizedTensor


def reason(
    q_shape, v_shape, dtype, spec: AttentionSpec, wide_heads=True, launches="per_gradient"
) -> Optional[str]:
    """None if the Mosaic GPU backward kernels run this call, else why not. Head dims over
    128 run only with ``wide_heads`` (``MosaicConfig.backward_wide_heads``, on by default)."""
    dqk, dv = q_shape[-1], v_shape[-1]
    if max(dqk, dv) > kernels.MAX_COLUMNS and not wide_heads:
        return (
            f"head dims ({dqk}, {dv}): MosaicConfig(backward_wide_heads=False) leaves head "
            f"dims over {kernels.MAX_COLUMNS} to the Triton backward passes"
        )
    if max(dqk, dv) > kernels.MAX_HEAD_DIM or dqk % 64 or dv % 64:
        return (
            f"head dims ({dqk}, {dv}): the Mosaic backward takes multiples of 64 up to "
            f"{kernels.MAX_HEAD_DIM}"
        )
    if launches == "per_chunk" and len(kernels.column_chunks(dv)) > len(kernels.column_chunks(dqk)):
        return f"head dims ({dqk}, {dv}): the Mosaic backward needs dv <= dqk above 128"
    if spec.tiles.ds_tile not in ds_tiles(spec.tiles.ds_scale):
        tiles = " or ".join(f"{q} x {k}" for q, k in ds_tiles(spec.tiles.ds_scale))
        return (
            f"dS scale tile {spec.tiles.ds_tile} with ds_scale={spec.tiles.ds_scale!r}: "
            f"the Mosaic backward's is {tiles}"
        )
    dq_key_tile = spec.tiles.bwd_block_k
    if not kernels.smem_fits(dqk, dv, kernel_dtype(dtype), launches, dq_key_tile):
        return (
            f"head dims ({dqk}, {dv}) with {jnp.dtype(kernel_dtype(dtype)).name} gradients "
            "do not fit shared memory in one backward stage; use bfloat16 inputs"
        )
    return None


def ds_tiles(ds_scale: str) -> tuple:
    """The dS scale tiles (queries, keys) the Mosaic backward runs for ``ds_scale``: 64 x 64
    (the key pass's steps of 64 queries, the dQ pass's of 64 keys), and with one scale per
    tile row also 64 x 128: dQ's per-query scales over 128 keys, the dQ pass stepping 128
    keys (one K scale block), while dK's per-key scales stay over 64 queries."""
    tiles = ((kernels.TILE, kernels.TILE),)
    return tiles + ((kernels.TILE, BLOCK),) if ds_scale == "rows" else tiles


class Operands(NamedTuple):
    """What the three passes read (padded, quantized) and their keyword arguments."""

    q8: MosaicOperand  # values and the permuted K-major copy
    k8: MosaicOperand
    v8: MosaicOperand  # values only
    do8: MosaicOperand
    # [B, Hkv, Sp / 64, 3, 64] per 64-key tile: K's and V's decode factors (repeated) and
    # the keys' poison (NaN for a key whose K or V row was not finite, else 0)
    kv_aux: jax.Array
    kv_flags: jax.Array  # [B, Hkv, FLAG_WORDS] int32: 1 where a (batch, kv head) has a bad key
    q_poison: jax.Array  # [B, Hq, Tp] f32: NaN for rows with a bad Q, dO or lse
    lse2: jax.Array  # [B, Hq, Tp] f32, log2 units (0 where lse was NaN: poisoned instead)
    segments: tuple  # (q_seg [B, Tp], kv_seg [B, Sp]) or ()
    kwargs: dict
    delta_key_tile: int = kernels.TILE  # keys per step of the matched-delta pass
    dq_key_tile: int = kernels.TILE  # keys per step of the dQ pass (the dS tile's keys)
    dq_in_key_pass: bool = False  # dQ by reduce-add from the key pass (no dQ pass)
    wide_launches: str = "per_gradient"  # head dims over 128 (backward.key_pass_launches)
    # causal query passes: the query tiles that see the most keys launch first (the key
    # pass's grid order already starts with the key blocks that see the most queries)
    longest_first: bool = False
    # with segment ids and MosaicConfig.document_tiles: {loop: bounds rows} of the tiles
    # wholly inside a document (.documents): "delta" and "dq" (query passes), "keys"
    doc_tiles: Optional[dict] = None
    # the key pass's S^T / dP^T A operands from registers ("k", "kv") or shared memory ("")
    key_operand_registers: str = ""
    # the query passes' S / dP^ A operands from registers ("q", "qdo") or shared memory ("")
    query_operand_registers: str = ""


def operands(
    q,
    k,
    v,
    lse,
    do,
    q_ids,
    kv_ids,
    *,
    spec,
    stages,
    fused_quantize,
    interpret,
    delta_key_tile=128,
    pingpong=False,
    quantize_warps=quantize_kernel.WARPS,
    dq_in_key_pass=False,
    wide_launches="per_gradient",
    longest_first=False,
    document_tiles=False,
    piece_columns=0,
    shared_quantize=False,
    early_p=False,
    chained_dots=False,
    key_operand_registers="",
    query_operand_registers="",
):
    quantize = quantize_kernel.quantizer(fused_quantize, interpret, quantize_warps)
    q8, k8, v8 = quantize_all(quantize, q, k, v, shared_quantize)
    do8 = quantize(do, k_major=True)
    tp, sp = q8.values.shape[2], k8.values.shape[2]
    segments = ()
    if q_ids is not None:
        segments = (pad_segment_ids(q_ids, tp, -1), pad_segment_ids(kv_ids, sp, -2))
    # lse = +inf (a row that sees no key) stays +inf: P = 0 there; a NaN lse (a row that
    # saw a bad token) is zeroed and poisons the row instead
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, tp - lse.shape[2])))
    q_poison = numerics.poison(q8.nonfinite | do8.nonfinite | jnp.isnan(lse))
    lse2 = jnp.where(jnp.isnan(lse), 0.0, lse * kernels.LOG2E)
    mask = ForwardMask(t=q.shape[1], s=k.shape[1], causal=spec.causal, segments=bool(segments))
    doc_tiles = None
    if segments and document_tiles:
        doc_tiles = dict(
            delta=documents.query_tiles(*segments, mask, delta_key_tile),
            dq=documents.query_tiles(*segments, mask, spec.tiles.bwd_block_k),
            keys=documents.key_tiles(*segments, mask),
        )
    kwargs = dict(
        mask=mask,
        sm_scale=spec.sm_scale,
        stages=stages,
        interpret=interpret,
        pingpong=pingpong,
        pieces=dot_pieces(
            piece_columns, bool(segments), spec.tiles.bwd_block_k, chained=chained_dots
        ),
        early_p=early_p,
        chained=chained_dots,
        ds_rows=spec.tiles.ds_scale == "rows",  # one dS^ scale per tile row, as the spec says
    )
    b, hkv = k8.inv_rows.shape[:2]
    # each 128-key block's factors (repeated over 64 rows) once per 64-key tile
    inv_k, inv_v = (jnp.repeat(x.inv_rows, BLOCK // kernels.TILE, axis=2) for x in (k8, v8))
    bad_keys = k8.nonfinite | v8.nonfinite
    k_poison = numerics.poison(bad_keys).reshape(b, hkv, sp // kernels.TILE, kernels.TILE)
    kv_aux = jnp.stack([inv_k, inv_v, k_poison], axis=3)
    return Operands(
        q8,
        k8,
        v8,
        do8,
        kv_aux,
        poison_flags(bad_keys),
        q_poison,
        lse2,
        segments,
        kwargs,
        delta_key_tile,
        spec.tiles.bwd_block_k,
        dq_in_key_pass,
        wide_launches,
        longest_first,
        doc_tiles,
        key_operand_registers,
        query_operand_registers,
    )


def quantize_all(quantize, q, k, v, shared: bool):
    """The backward's Q, K (values and permuted K-major copies) and V (values). ``shared``:
    V's permuted K-major copy too, so these three calls are exactly the forward's
    (``MosaicConfig.shared_quantize``) and XLA may run each once for both."""
    q8, k8 = quantize(q, k_major=True), quantize(k, k_major=True)
    return q8, k8, quantize(v, k_major=shared)


def dot_pieces(
    piece_columns: int, segments: bool, dq_key_tile: int = kernels.TILE, chained: bool = False
) -> int:
    """Columns of each fresh dot in the backward passes: ``piece_columns``, or for 0 the
    measured choice, SEGMENT_PIECES with segment ids or with the dQ pass in 128-key steps
    (its [64, 128] dS tile beside dQ's accumulator spilled 1,120 bytes at 128 columns,
    causal, and 636 at 64, which ran the causal step's kernels 10% faster on an H100:
    docs/mosaic_gpu.md, "The dQ pass in 128-key steps"), MAX_COLUMNS otherwise (never more).
    ``chained`` (two dots in flight, :func:`.backward._accumulate_chained`): SEGMENT_PIECES,
    so the two fresh accumulators hold what one 128-column one does."""
    narrow = segments or chained or dq_key_tile != kernels.TILE
    auto = kernels.SEGMENT_PIECES if narrow else kernels.MAX_COLUMNS
    return min(piece_columns or auto, kernels.MAX_COLUMNS)


def query_rows(ops: Operands, delta_p):
    """[B, Hq, Tp / 64, 5, 64] f32: per query (lse2, delta, inv_q, inv_do, poison); a
    non-finite delta is zeroed and poisons its row instead."""
    poison = ops.q_poison + numerics.poison(~jnp.isfinite(delta_p))
    delta_p = numerics.finite_or_zero(delta_p)
    rows = [ops.lse2, delta_p, ops.q8.inv_tokens, ops.do8.inv_tokens, poison]
    rows = jnp.stack(rows, axis=2)
    b, hq, n, tp = rows.shape
    rows = rows.reshape(b, hq, n, tp // kernels.TILE, kernels.TILE)
    return jnp.swapaxes(rows, 2, 3)


def query_flags(rows, hkv: int):
    """[B, Hkv, FLAG_WORDS] int32: the key pass's poison flags, 1 where a query of one of
    the kv head's query heads is poisoned in ``rows`` (:func:`query_rows`)."""
    b, hq, n, _, tile = rows.shape
    bad_queries = jnp.isnan(rows[:, :, :, 4]).reshape(b, hq, n * tile)
    return poison_flags(bad_queries, hq // hkv)


# dS = P (dP^ - delta) with |dP^| <= Dv 448^2 inv_do inv_v (e4m3's max; Dv <= 2^8): below
# these bounds on inv_do inv_v and |delta| every |dS| stays under 2^126, so no dS is Inf
DS_FACTOR_BOUND = 2.0**96
DS_DELTA_BOUND = 2.0**124


def ds_range_flags(ops: Operands, rows):
    """[B, Hkv, FLAG_WORDS] int32: 1 where a (batch, kv head)'s dS could overflow to Inf
    (the largest dO and V decode factors of its heads past DS_FACTOR_BOUND, or a |delta|
    past DS_DELTA_BOUND: only inputs near the f32 range). Such CTAs run every step masked,
    whose dS^ cast turns Inf into NaN; the others cast without that code."""
    hkv = ops.v8.inv_tokens.shape[1]
    b, hq, tp = ops.do8.inv_tokens.shape

    def per_kv_head(x_BHT):
        return jnp.max(x_BHT.reshape(b, hkv, -1), axis=-1)

    inv_do = per_kv_head(ops.do8.inv_tokens)
    delta = per_kv_head(jnp.abs(rows[:, :, :, 1]).reshape(b, hq, tp))
    risky = (inv_do * jnp.max(ops.v8.inv_tokens, axis=-1) >= DS_FACTOR_BOUND) | (
        delta >= DS_DELTA_BOUND
    )
    return poison_flags(risky[..., None])


def _query_pass(ops: Operands, rows, flags=None, **kwargs):
    kt = ops.k8.values_t if kwargs["want"] == "dq" else None
    tiles = None if ops.doc_tiles is None else ops.doc_tiles[kwargs["want"]]
    q8, do8, k8, v8 = ops.q8.values, ops.do8.values, ops.k8.values, ops.v8.values
    return kernels.query_pass(
        q8,
        do8,
        rows,
        k8,
        v8,
        ops.kv_aux,
        ops.kv_flags if flags is None else flags,
        kt,
        *ops.segments,
        longest_first=ops.longest_first,
        doc_tiles=tiles,
        operand_registers=ops.query_operand_registers,
        **kwargs,
        **ops.kwargs,
    )


def delta(ops: Operands, do, out, mode: str):
    """delta [B, Hq, Tp] f32: the matched pass, or the row dot of dO (or dO^) and O."""
    if mode == "matched":
        rows = query_rows(ops, jnp.zeros_like(ops.lse2))  # (the pass reads no delta)
        return _query_pass(ops, rows, want="delta", key_tile=ops.delta_key_tile)
    # the row dot's view of dO^ (do_matched reads its values and decode factors)
    do8 = QuantizedTensor(ops.do8.values, None, ops.do8.inv_tokens, ops.do8.nonfinite)
    return delta_kernels.row_dot_delta(mode, do, out, do8, ops.lse2.shape[2])


def _concat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def gradients(ops: Operands, delta_p, out_dtypes, with_stats=False, passes=("dq", "dkdv")):
    """(dQ [B, Tp, Hq, Dqk], dK [B, Sp, Hkv, Dqk], dV [B, Sp, Hkv, Dv], stats), padded;
    stats: the dS row statistics [B, Hq, 4, Tp] with ``with_stats``, else None. A pass
    left out of ``passes`` gives None (the benchmarks time each pass on its own). Head
    dims over 128: the launches of ``ops.wide_launches``, concatenated. With ``ops.dq_in_key_pass``
    the key pass forms dQ too (``passes`` naming "dkdv"), except with ``with_stats`` (the
    statistics come from the dQ pass), with dS^ scales per tile row (``ds_rows``: per-key
    scales vary along the dQ dot's contraction) or where that key pass does not fit shared memory
    (:func:`.backward.dq_in_key_pass_fits`): there the dQ pass runs."""
    rows = query_rows(ops, delta_p)
    q_dtype, kv_dtype = out_dtypes
    dqk, dv_dim = ops.q8.values.shape[-1], ops.v8.values.shape[-1]
    dq_from_keys = (
        ops.dq_in_key_pass
        and not with_stats
        and not ops.kwargs["ds_rows"]  # per-key dS^ scales vary along the dQ dot's keys
        and "dkdv" in passes
        and kernels.dq_in_key_pass_fits(dqk, dv_dim, kv_dtype)
    )
    dq = stats = dk = dv = None
    range_flags = ds_range_flags(ops, rows)  # dS^'s Inf code where dS could overflow
    if "dq" in passes and not dq_from_keys:
        parts = []
        for n, cols in enumerate(kernels.query_pass_launches(dqk, ops.wide_launches)):
            stats_here = with_stats and n == 0  # every chunk forms the same dS
            part = _query_pass(
                ops,
                rows,
                jnp.maximum(ops.kv_flags, range_flags),
                want="dq",
                out_dtype=q_dtype,
                with_stats=stats_here,
                dq_cols=cols,
                key_tile=ops.dq_key_tile,
            )
            part, stats = part if stats_here else (part, stats)
            parts.append(part)
        dq = _concat(parts)
    if "dkdv" in passes:
        q_flags = jnp.maximum(query_flags(rows, ops.k8.values.shape[1]), range_flags)
        dk_parts, dv_parts, dq_parts = [], [], []
        wide = "per_chunk" if dq_from_keys else ops.wide_launches
        for dk_cols, dv_cols in kernels.key_pass_launches(dqk, dv_dim, wide):
            parts = kernels.key_pass(
                ops.q8.values,
                ops.q8.values_t,
                ops.do8.values,
                ops.do8.values_t,
                rows,
                ops.k8.values,
                ops.v8.values,
                ops.kv_aux,
                q_flags,
                *ops.segments,
                out_dtype=kv_dtype,
                dk_cols=dk_cols,
                dv_cols=dv_cols,
                kt8=ops.k8.values_t if dq_from_keys else None,
                doc_tiles=None if ops.doc_tiles is None else ops.doc_tiles["keys"],
                operand_registers=ops.key_operand_registers,
                **ops.kwargs,
            )
            dk_parts += [parts[0]] if parts[0] is not None else []
            dv_parts += [parts[1]] if parts[1] is not None else []
            dq_parts += [parts[2].astype(q_dtype)] if dq_from_keys else []
        dk, dv = _concat(dk_parts), _concat(dv_parts)
        dq = _concat(dq_parts) if dq_from_keys else dq
    return dq, dk, dv, stats


def backward(ops: Operands, do, out, mode: str, dtypes, with_stats: bool) -> BackwardResult:
    """Flash backward in Mosaic GPU kernels, ``dtypes`` those of (q, k, v)."""
    t, s = do.shape[1], ops.kwargs["mask"].s
    q_dtype, k_dtype, v_dtype = dtypes
    delta_p = delta(ops, do, out, mode)
    out_dtypes = (kernel_dtype(q_dtype), kernel_dtype(k_dtype))
    dq, dk, dv, stats = gradients(ops, delta_p, out_dtypes, with_stats)
    return BackwardResult(
        dq[:, :t].astype(q_dtype),
        dk[:, :s].astype(k_dtype),
        dv[:, :s].astype(v_dtype),
        delta_p[:, :, :t],
        *(() if stats is None else (stats[:, :, n, :t] for n in range(4))),
    )
