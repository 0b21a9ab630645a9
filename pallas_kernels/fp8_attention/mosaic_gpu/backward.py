"""Mosaic GPU backward kernels: the matched delta, dQ, and dK/dV, every dot in FP8 e4m3.

Both kinds of pass recompute, per (64 queries x 64 keys) tile, in log2 units
(c = sm_scale log2(e), lse2 = lse log2(e), inv the decode factors, constant per tile):
    S2  = (Q8 K8^T) * (c inv_q inv_k + poison_row) + poison_col,   -inf where masked
    P   = 2^(S2 - lse2)
    dP^ = (dO8 V8^T) * (inv_do inv_v)
    dS  = P (dP^ - delta),  s = 2^floor(log2(448 / amax|dS|)),  dS^ = e4m3(dS s)
                                     (no clip needed: |dS s| <= 448 exactly)
(poison: NaN for a query row or key whose operands were not finite, else 0, so NaN reaches
exactly the visible pairs. The row's poison rides in its factor; the column's is added on
masked steps only, and a CTA with a bad token on its column side (keys in the query pass,
queries in the key pass: :func:`.forward.poison_flags`) takes every step masked. So an
unmasked step forms S2 - lse2 in one multiply-add per score: the same values. Its dS^ cast
also drops the Inf code, where no dS of the CTA can overflow, by the same flags.) The matched
delta sums P_ij (dO8 V8^T)_ij and applies dP^'s factor to the tile's row sums: a power of
two, so the same bits as summing P_ij dP^_ij. The 64 x 64 tile is the contract's dS scale tile
(``NumericsTiles.ds_tile``); the amax runs over each row of the accumulator (``ds_rows``,
``NumericsTiles.ds_scale="rows"``: per query in the query pass, per key in the key pass,
within one warp's quad of threads) or over the whole tile (a cross-warp max through shared
memory), so dS is scaled exactly as the emulation scales it. Every scale factor is a power of two apart from
c, so the order of the multiplications does not change a bit.

* :func:`query_pass` (one CTA per 128 queries, two consumer warpgroups of 64 rows, keys
  streamed in 64-token tiles): with ``want="delta"`` the matched delta
  delta_i = sum_j P_ij dP^_ij; with ``want="dq"``
  dQ_i += (dS^ K8) * (sm_scale / s * inv_k)        A = dS^ from registers, K^T K-major.
* :func:`key_pass` (one CTA per 128 keys, 64 per consumer warpgroup, queries of every head
  of the kv head's group streamed in 64-token tiles) works on the transposed tiles
  (S^T = K8 Q8^T, dP^T = V8 dO8^T: keys are the accumulator's rows):
    dV_j += ((256 P)^^T dO8) * (inv_do / 256)        A = P^T from registers
    dK_j += (dS^^T Q8) * (sm_scale / s * inv_q)       A = dS^T from registers
  with dO^T and Q^T K-major, tokens permuted like the register regroup (:mod:`.regroup`).

Each tile's dot runs in a fresh accumulator and is added in FP32 (the Triton backend's
default accumulation). A producer warpgroup streams the tiles with TMA into a ring of
shared-memory stages. With ``pingpong`` the two consumer warpgroups take turns on the tensor
cores, as the forward's do: a two-party barrier after each warpgroup issues its S and dP^
dots and another before its register dots, with warpgroup 1 one phase ahead, so one
warpgroup's tile math (exp2, dS, its amax and casts) runs while the other's dots do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.mosaic_gpu import regroup
from pallas_kernels.fp8_attention.mosaic_gpu.forward import (
    FLAG_WORDS,
    LOG2E,
    SMEM_BYTES,
    WARPGROUPS,
    ForwardMask,
    clean_columns,
    clean_document_bounds,
    clean_full,
    consumer_registers,
    cta_range,
    document_loops,
    fitting,
    fp8_transforms,
    out_transforms,
    producer_registers,
    producer_row,
    query_tile,
    warp_specialized_call,
)
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import BLOCK

TILE = 64  # tokens per streamed tile and per consumer warpgroup: the dS scale tile
CTA_TOKENS = WARPGROUPS * TILE
F32 = jnp.float32
F16 = jnp.float16
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column
MAX_HEAD_DIM = 256
# accumulator columns of one fresh dot, and of each of dK and dV when one launch forms
# both (with a fresh dot, 192 registers per thread); wider gradients form their dots in
# pieces (:func:`column_pieces`), in one launch each or one launch per chunk
MAX_COLUMNS = 128
# accumulator columns of one fresh dot in calls with segment ids: the masked steps' ids and
# compares sit beside the dK and dV accumulators, and a 64-column dot result (32 registers
# per thread instead of 64) took the D=128 key pass with documents from 2,436 bytes of
# ptxas spills to 832 and 892 to 604 us on the H200, bitwise the same (docs/mosaic_gpu.md,
# "What a CTA pays once, and dots in 64-column pieces"); without segment ids 128 stays
# faster
SEGMENT_PIECES = 64
# GQA key pass: query heads per kv head whose loops are written out one after the other
# (a loop over the heads around them spilled 784-924 bytes on the H200 and ran 1.6-1.8x
# slower at 2 heads per kv head; docs/mosaic_gpu.md)
MAX_UNROLLED_HEADS = 8
REDUCTION_SCRATCH = 128  # f32 per warpgroup for the cross-warp max of a dS tile
ROWS = 5  # per-query rows of q_rows: lse2, delta, inv_q, inv_do, poison


def _scale(amax, shape):
    """The power-of-two scale of a tile's amax (a [64] row vector, all entries equal) as
    ``shape``, broadcast along the rows."""
    return _rows(numerics.pow2_scale(amax), shape)


def _row_max(rows, scratch, interpret: bool):
    """max over a [64] row vector, returned as a row vector of that max. The rows of a
    warpgroup's tile lie in its four warps, so this is a cross-warp reduction through
    shared memory: through this warpgroup's own ``scratch`` ([128] f32), since Pallas' own
    reduction scratch sits at one address for every warpgroup of the CTA."""
    if interpret:
        return lax.broadcast_in_dim(rows.max(axis=0), rows.shape, ())

    @plgpu.inline_mgpu(
        arg_types=(ROW, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct(rows.shape, rows.dtype, layout=ROW),
    )
    def row_max(_, x, scratch_ref):
        total = x.reduce("max", 0, scratch=scratch_ref)
        return total.broadcast(x.shape).to_layout(ROW.to_mgpu())

    return row_max(rows, scratch)


# (bits(x) << 1) + FINITE, unsigned: |x|'s bits (the shift drops the sign) moved up by
# FINITE, so Inf and NaN (|bits| >= 0x7f800000) wrap below every finite value, and the
# largest code belongs to the largest finite |x|. Two integer ops per element (shift-add,
# max) where |x|, an Inf/NaN test, a select and a float max took four.
FINITE = 0x01000000


def _finite_row_amax(x):
    """max |x| over finite entries, per row (0 for a row with none): the row maxima of the
    codes above, decoded."""
    code = lax.shift_left(lax.bitcast_convert_type(x, jnp.uint32), jnp.uint32(1))
    top = (code + jnp.uint32(FINITE)).max(axis=1)
    bits = jnp.where(top >= FINITE, lax.shift_right_logical(top - FINITE, jnp.uint32(1)), 0)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), F32)


def _quantize_ds(ds, scratch, interpret: bool, rows: bool = False, encode: bool = True):
    """dS tile -> (dS^ e4m3, its finite amax as a [64] row vector): one power-of-two scale
    per tile, or with ``rows`` one per row of the tile (no cross-warp reduction: a row lies
    in one warp's quad of threads). NaN and Inf do not poison it. ``encode``: Inf is cast
    to NaN (an FFMA per element); off where the tile cannot hold Inf (unmasked steps of a
    CTA without a flag: :func:`.backward_ops.ds_range_flags`), the same bits."""
    amax = _finite_row_amax(ds)
    if not rows:
        amax = _row_max(amax, scratch, interpret)
    quantize = numerics.quantize_by_own_amax if encode else numerics.quantize_finite_by_own_amax
    return quantize(ds, _scale(amax, ds.shape)), amax


def _rows(vec, shape):
    return lax.broadcast_in_dim(vec, shape, [0])


def _row(ref):
    """A [64] vector from shared memory, one value per accumulator row. Tile constants
    (decode factors) are read this way too: constant vectors fit either orientation."""
    return plgpu.load(ref, (), layout=ROW)


def _masked(mask: ForwardMask, s2, q0, k0, transposed: bool, padded_to, q_seg=None, k_seg=None):
    """-inf where the (query, key) pair is masked: lengths, causality, segments. Rows are
    queries from ``q0`` and columns keys from ``k0``, or the other way when ``transposed``;
    q_seg and k_seg are the segment-id vectors along their axes. ``padded_to`` (Tp, Sp): a
    length equal to its padded size holds every position, so it takes no compare (fewer
    ops and registers on the causal diagonal's steps; the same values)."""
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    tp, sp = padded_to

    def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, s2.shape, axis, layout=plgpu.Layout.WGMMA)

    tests = []
    if mask.t != tp or mask.causal:
        q_pos = q0 + iota(q_axis)
    if mask.s != sp or mask.causal:
        k_pos = k0 + iota(k_axis)
    if mask.t != tp:
        tests.append(q_pos < mask.t)
    if mask.s != sp:
        tests.append(k_pos < mask.s)
    if mask.causal:
        tests.append(q_pos >= k_pos)
    if mask.segments:
        q_ids = lax.broadcast_in_dim(q_seg, s2.shape, [q_axis])
        tests.append(q_ids == lax.broadcast_in_dim(k_seg, s2.shape, [k_axis]))
    if not tests:  # a step masked for its poison only (a flagged CTA)
        return s2
    return jnp.where(functools.reduce(jnp.logical_and, tests), s2, -jnp.inf)


def _padded(mask: ForwardMask, tp: int, sp: int) -> bool:
    return mask.t != tp or mask.s != sp


def _issue(accs, pairs, after_issue):
    """acc += a @ b on the tensor cores for each pair, not waited for; then
    ``after_issue()``."""
    for acc, (a, b) in zip(accs, pairs):
        plgpu.wgmma(acc, a, b)
    if after_issue is not None:
        after_issue()


def _dots(pairs, shape, after_issue=None):
    """[a @ b for (a, b) in pairs] in fresh f32 accumulators, issued together (one wait);
    ``after_issue()`` runs between issuing them and waiting for them."""

    def body(*accs):
        _issue(accs, pairs, after_issue)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(body, *(plgpu.ACC(shape, F32) for _ in pairs))


def _dots_first(pairs, shape, first, after_issue=None, early: bool = True):
    """``(first(a0 @ b0), a1 @ b1, ...)`` for ``pairs`` in fresh f32 accumulators, issued
    together. ``early``: ``first`` runs as soon as the first dot is done, while the others
    still run on the tensor cores (one ``wgmma.wait_group`` per dot instead of one for
    all); else after all of them. The same values either way: only the schedule moves."""
    if not early:
        head, *rest = _dots(pairs, shape, after_issue)
        return (first(head), *rest)

    def body(*accs):
        _issue(accs, pairs, after_issue)
        head = first(plgpu.wgmma_accumulator_load(accs[0], wait_n=len(pairs) - 1))
        return (head, *(acc[...] for acc in accs[1:]))

    return pl.run_scoped(body, *(plgpu.ACC(shape, F32) for _ in pairs))


class _Schedule:
    """The ping-pong of the two consumer warpgroups (``pingpong``), or nothing.

    ``barrier``: a two-party barrier (one arrival per consumer warpgroup) or None. Each
    warpgroup passes it twice per step (``after_issue``, then ``arrive`` ... ``wait``
    around its register dots); ``start`` puts warpgroup 1 one phase ahead and ``finish``
    evens the count, so both pass it equally often (``skip`` for a step a warpgroup does
    not compute)."""

    def __init__(self, barrier, wg, per_step: int = 2):
        self.barrier, self.wg, self.per_step = barrier, wg, per_step

    def _sync(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    @property
    def after_issue(self):
        return self._sync if self.barrier is not None else None

    def start(self):
        if self.barrier is not None:
            pl.when(self.wg == 1)(self._sync)

    def finish(self):
        if self.barrier is not None:
            pl.when(self.wg == 0)(self._sync)

    def skip(self):
        if self.barrier is not None:
            for _ in range(self.per_step):
                self._sync()

    def arrive(self, values):
        """Finishes ``values`` (the math the register dots read) and frees the tensor cores
        for the other warpgroup; returns them."""
        if self.barrier is None:
            return values
        values = lax.optimization_barrier(values)
        plgpu.barrier_arrive(self.barrier)
        return values

    def wait(self):
        """Until the other warpgroup's dots are issued and done with."""
        if self.barrier is not None:
            plgpu.barrier_wait(self.barrier)


def _register_dot(a8, b_ref, shape, interpret, a_smem, staged=False):
    """a8 (e4m3, registers, regrouped) @ b_ref in a fresh f32 accumulator. Pallas' GPU
    interpreter takes wgmma's A operand from shared memory only: it goes through ``a_smem``
    (``staged``: already there)."""
    if interpret:
        if not staged:
            a_smem[...] = a8
            plgpu.commit_smem()
        a8 = a_smem

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a8, b_ref)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, F32))


def _accumulate(accs, a8, bt_ref, factor, interpret, a_smem):
    """accs[n] + (a8 @ bt_ref[cols_n]^T) * factor for each piece n of the accumulator's
    columns (:func:`column_pieces`, the pieces' widths): one fresh f32 accumulator of one
    piece at a time, so a launch holds up to MAX_HEAD_DIM columns (``bt_ref``: the
    K-major operand, one row per accumulator column). Each column's sum is the one a
    launch of that piece alone forms. ``factor(shape)``: the tile's descale."""
    out = []
    for n, (acc, b_ref) in enumerate(zip(accs, _piece_operands(accs, bt_ref))):
        part = _register_dot(a8, b_ref, (TILE, acc.shape[1]), interpret, a_smem, staged=n > 0)
        out.append(acc + part * factor(part.shape))
    return tuple(out)


def _piece_operands(accs, bt_ref):
    """The B operand of each accumulator piece: its columns' rows of the K-major
    ``bt_ref``, transposed (the whole of it for a single piece)."""
    if len(accs) == 1:
        return [bt_ref.T]
    los = [sum(acc.shape[1] for acc in accs[:n]) for n in range(len(accs))]
    return [bt_ref.at[pl.ds(lo, acc.shape[1])].T for lo, acc in zip(los, accs)]


def _register_operands(refs, count: int, interpret: bool):
    """The A-operand tiles ``refs`` of a pass's S and dP^ dots, the first ``count`` of them
    loaded once into registers (the 8-bit operand layout, columns in order), the others
    left in shared memory; Pallas' GPU interpreter reads shared memory only."""
    if interpret:
        return tuple(refs)
    return tuple(
        plgpu.load(ref, (), layout=plgpu.Layout.WGMMA_8BIT) if n < count else ref
        for n, ref in enumerate(refs)
    )


def _accumulate_chained(jobs, interpret, a_smems):
    """:func:`_accumulate` for each job (accs, a8, bt_ref, factor) in turn, its pieces in
    one chain with two dots in flight: piece n's f32 result is added while piece n + 1's
    dot runs (``wgmma.wait_group 1``), so the adds hide under the tensor cores instead of
    waiting for them. Every piece's dot and add are :func:`_accumulate`'s, so the sums
    are bitwise the same; two fresh accumulators are live at a time (pieces of 64
    columns hold what one 128-column piece does). In Pallas' GPU interpreter each job's
    operand goes through its own ``a_smems[j]``."""
    pieces = []
    for j, (accs, a8, bt_ref, factor) in enumerate(jobs):
        if interpret:
            a_smems[j][...] = a8
            a8 = a_smems[j]
        for acc, b_ref in zip(accs, _piece_operands(accs, bt_ref)):
            pieces.append((acc, a8, b_ref, factor))
    if interpret:
        plgpu.commit_smem()

    def add(n, acc_ref, wait_n):
        acc, _, _, factor = pieces[n]
        part = plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)
        return acc + part * factor(part.shape)

    def issue(n, pending):  # pending: (piece, its accumulator) issued, not yet added
        if n == len(pieces):
            return (add(*pending, wait_n=0),)
        acc, a8, b_ref, _ = pieces[n]

        def body(acc_ref):
            plgpu.wgmma(acc_ref, a8, b_ref)
            done = () if pending is None else (add(*pending, wait_n=1),)
            return done + issue(n + 1, (n, acc_ref))

        return pl.run_scoped(body, plgpu.ACC(acc.shape, F32))

    flat = list(issue(0, None))
    return [tuple(flat.pop(0) for _ in accs) for accs, *_ in jobs]


def _zero_pieces(cols: int, width):
    """Zeroed accumulators for ``cols`` columns, one per :func:`column_pieces` piece."""
    return tuple(
        plgpu.layout_cast(jnp.zeros((TILE, w), F32), plgpu.Layout.WGMMA)
        for _, w in column_pieces(cols, width)
    )


def _store_pieces(accs, bufs, dst, out_dtype):
    """The accumulator pieces to global memory, ``dst(first, count)`` the destination of a
    piece's columns; ``bufs`` one staging tile per piece, or a single one that every piece
    reuses once the previous piece's copy has read it (equal widths: less shared memory)."""
    lo = 0
    for n, acc in enumerate(accs):
        width = acc.shape[1]
        buf = bufs[n] if len(bufs) > 1 else bufs[0]
        if n and len(bufs) == 1:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        buf[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, dst(lo, width))
        lo += width


def _staging_widths(cols: int, width) -> list[int]:
    """Columns of each staging tile :func:`_store_pieces` writes ``cols`` columns through
    (pieces of ``width``): one per piece, or a single one when every piece has its width."""
    widths = [w for _, w in column_pieces(cols, width)]
    return widths[:1] if len(set(widths)) == 1 else widths


def _staging(cols: int, out_dtype, width, lead=(WARPGROUPS,)):
    """The shared-memory tiles :func:`_store_pieces` writes through for ``cols`` columns."""
    return tuple(
        plgpu.SMEM(lead + (TILE, w), out_dtype, transforms=out_transforms(out_dtype))
        for w in _staging_widths(cols, width)
    )


def _staging_bytes(cols: int, itemsize: int, width) -> int:
    return TILE * sum(_staging_widths(cols, width)) * itemsize


def _transposed_operand(ds8t, ds_t_smem, to_operand):
    """dS^ [queries, keys] as the register A operand of the dQ dot, from the key pass'
    dS^T^ tile [keys, queries] (e4m3, accumulator layout). Hopper has no transposing 8-bit
    shared-memory store, so the tile goes through a 16-bit one; e4m3 values are exact in
    f16, so every bit comes back."""
    ds_t_smem.T[...] = ds8t.astype(F16)
    ds = plgpu.load(ds_t_smem, (), layout=plgpu.Layout.WGMMA)
    return to_operand(ds.astype(ds8t.dtype))


def _dq_block(k_block, wg, interpret: bool):
    """The f32 dQ buffer a warpgroup adds into: one for all on the GPU; its own in Pallas'
    GPU interpreter, which has no reduce-add copy (the partials are summed after)."""
    return k_block * WARPGROUPS + wg if interpret else 0


def _reduce_dq(part, stage, dq_tile, interpret: bool):
    """dQ tile += part ([64, cols] f32): staged in shared memory once the previous tile's
    reduce has read it, then one TMA reduce-add (a plain copy in the interpreter)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = part
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dq_tile, reduction_op=None if interpret else "add")


def _stream(load, free, steps, stages: int, first=0):
    """The producer's loop: ``load(first + n, slot)`` for steps n < ``steps`` into a ring
    of ``stages`` slots (n's slot: n % stages), each reused once the consumers release it
    (``free``); then it waits for the last releases too (Pallas' GPU interpreter checks
    that every phase was observed)."""

    @pl.loop(0, steps)
    def _(n):
        slot = lax.rem(n, stages)

        @pl.when(n >= stages)
        def _():
            plgpu.barrier_wait(free.at[slot])

        load(first + n, slot)

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(n):
        plgpu.barrier_wait(free.at[lax.rem(n, stages)])


def _copy_to_slot(copies, slot):
    """TMA copies (source, staged buffer, its barriers) into one stage slot, one barrier
    per copy (Pallas' GPU interpreter counts one arrival per barrier and copy)."""
    for src, dst, bars in copies:
        plgpu.copy_gmem_to_smem(src, dst.at[slot], bars.at[slot])


def _wait_all(bars, slot):
    for bar in bars:
        plgpu.barrier_wait(bar.at[slot])


def query_pass(
    q8,
    do8,
    q_rows,
    k8,
    v8,
    kv_aux,
    kv_flags,
    kt8=None,
    q_seg=None,
    kv_seg=None,
    *,
    want: str,
    mask: ForwardMask,
    sm_scale: float,
    stages: int,
    out_dtype=jnp.float32,
    with_stats: bool = False,
    interpret: bool = False,
    key_tile: int = TILE,
    pingpong: bool = False,
    dq_cols=None,
    longest_first: bool = False,
    doc_tiles=None,
    pieces=None,
    early_p: bool = False,
    ds_rows: bool = False,
    chained: bool = False,
    operand_registers: str = "",
):
    """The matched delta or dQ (and, ``with_stats``, the dS row statistics).

    Args:
      q8 [B, Hq, Tp, Dqk], do8 [B, Hq, Tp, Dv]: e4m3.
      q_rows [B, Hq, Tp / 64, 5, 64] f32: per query (lse2, delta, inv_q, inv_do, poison).
      k8 [B, Hkv, Sp, Dqk], v8 [B, Hkv, Sp, Dv]: e4m3.
      kv_aux [B, Hkv, Sp / 64, 3, 64] f32, per 64-key tile: K's and V's decode factors
        (repeated) and the keys' poison (NaN for a key whose K or V row was not finite).
      kv_flags [B, Hkv, FLAG_WORDS] int32 (:func:`.forward.poison_flags` of the bad keys,
        for dQ joined by :func:`.backward_ops.ds_range_flags`): where set, every step takes
        the masked path, which adds the keys' poison and casts dS^ with its Inf code.
      kt8 [B, Hkv, Dqk, Sp]: the permuted K-major copy of K (``want="dq"`` only).
      q_seg [B, Tp], kv_seg [B, Sp] int32 (only when ``mask.segments``).
      key_tile: keys per step, 64 or 128 (one K and one V scale block per step). For
        ``want="dq"`` the step is the dS scale tile's keys: 128 only with ``ds_rows``
        (``NumericsTiles(bwd_block_k=128, ds_scale="rows")``: one scale per query over
        the step's 128 keys); the delta pass forms no dS and takes either.
      pingpong: the consumer warpgroups take turns on the tensor cores (module docstring).
      dq_cols: (first, count): the columns of dQ this launch forms (default all, at most
        MAX_HEAD_DIM, in pieces of ``pieces`` columns: :func:`_accumulate`); S and dP^
        always contract the whole head dims.
      longest_first: causal only: the query tiles that see the most keys launch first
        (:func:`.forward.query_tile`).
      doc_tiles: [B, Tp / 64, 32] int32 (segments only; :func:`.documents.query_tiles` with
        ``key_tile``): per 64 query rows, the key tiles [first, stop) wholly inside the
        rows' document; they take the unmasked path (the same results).
      pieces: columns of each fresh dQ dot's accumulator (default MAX_COLUMNS), as in
        :func:`key_pass`.
      early_p: P is formed as soon as the S dot is done, while the dP^ dot still runs (the
        same values; :func:`_dots_first`).
      ds_rows: dS^ takes one scale per row of the tile (per query, over its 64 keys)
        instead of one per 64 x 64 tile (:func:`_quantize_ds`).
      chained: dQ's pieces in one chain, each piece's adds while the next piece's dot
        runs (:func:`_accumulate_chained`; the same bits).
      operand_registers: ``"q"``: the S dot takes Q from registers (loaded once per CTA)
        instead of shared memory; ``"qdo"``: the dP^ dot dO too; ``""``: neither. The same
        products (GPU only; the interpreter reads shared memory).
    Returns:
      ``want="delta"``: delta [B, Hq, Tp] f32; ``want="dq"``: dQ [B, Tp, Hq, count] in
      ``out_dtype`` (the public layout), with ``with_stats`` also [B, Hq, 4, Tp] f32:
      sum_j dS_ij and sum_j |dS_ij| before the cast of dS, then after it (decoded).
    """
    if want not in ("delta", "dq"):
        raise ValueError(f"want must be 'delta' or 'dq', got {want!r}")
    want_dq = want == "dq"
    with_stats = with_stats and want_dq
    b, hq, tp, dqk = q8.shape
    hkv, sp, dv = k8.shape[1], k8.shape[2], v8.shape[3]
    if key_tile not in (TILE, BLOCK) or (want_dq and key_tile != TILE and not ds_rows):
        raise ValueError(
            f"key_tile must be {TILE}, or {BLOCK} for want='delta' or for want='dq' with "
            f"ds_rows (one dS^ scale per query over the step's keys); got {key_tile} for "
            f"want={want!r}, ds_rows={ds_rows}"
        )
    if sp % key_tile:
        raise ValueError(f"S={sp} must be padded to a multiple of key_tile={key_tile}")
    (dq0, cq) = dq_cols or (0, dqk)
    if want_dq and not 0 < cq <= MAX_HEAD_DIM:
        raise ValueError(f"dq_cols: 1-{MAX_HEAD_DIM} columns, got {cq}")
    cq = cq if want_dq else 0
    n_dq = len(column_pieces(cq, pieces))  # dQ's accumulator pieces, first in the carry
    stages = fitting(stages, lambda n: query_pass_smem(n, dqk, dv, cq, key_tile, out_dtype, pieces))
    group = hq // hkv
    n_k = sp // key_tile
    if key_tile != TILE:  # each step's decode factors and poison as rows of key_tile
        n64 = kv_aux.shape[2]
        kv_aux = kv_aux.reshape(b, hkv, n64 // 2, 2, 3, TILE).swapaxes(3, 4)
        kv_aux = kv_aux.reshape(b, hkv, n64 // 2, 3, key_tile)
    every_tile = mask.segments or _padded(mask, tp, sp)
    documents = mask.segments and doc_tiles is not None
    c = sm_scale * LOG2E
    to_operand = regroup.operand_fn(interpret)

    def kernel(q_ref, do_ref, rows_ref, k_ref, v_ref, kvinv_ref, flags_ref, *rest):
        rest = list(rest)
        kt_ref = rest.pop(0) if want_dq else None
        qseg_ref, kvseg_ref = (rest.pop(0), rest.pop(0)) if mask.segments else (None, None)
        tiles_ref = rest.pop(0) if documents else None
        out_ref, stats_ref, scratch = rest if with_stats else (rest[0], None, rest[1])
        smem, bars = scratch
        q_smem2, do_smem2, rows_smem2, qseg_smem2, out_smem2, a_smem2, stats_smem2 = smem[:7]
        red_smem2, tiles_smem2 = smem[7:9]
        k_smem, v_smem, kt_smem, kvinv_smem, kseg_smem, flags_smem2 = smem[9:]
        q_bars, k_bars, v_bars, kt_bars, aux_bars, seg_bars, free, schedule = bars
        batch, head = lax.axis_index("batch"), lax.axis_index("heads")
        q_tile = query_tile(tp // CTA_TOKENS, mask.causal and longest_first)
        wg = lax.axis_index("wg")
        turns = _Schedule(schedule, wg, per_step=2 if want_dq else 1)
        kv_head = lax.div(head, jnp.array(group, head.dtype))
        if mask.causal:
            cta_steps = jnp.minimum(n_k, (q_tile + 1) * CTA_TOKENS // key_tile)
        else:
            cta_steps = n_k

        @pl.when(wg < WARPGROUPS)
        def _consumer():
            consumer_registers()
            q_smem, do_smem, rows_smem = q_smem2.at[wg], do_smem2.at[wg], rows_smem2.at[wg]
            tile = q_tile * WARPGROUPS + wg
            row0 = tile * TILE
            q_rows_ = pl.ds(row0, TILE)
            copies = [
                (q_ref.at[batch, head, q_rows_], q_smem),
                (do_ref.at[batch, head, q_rows_], do_smem),
                (rows_ref.at[batch, head, tile], rows_smem),
            ]
            if mask.segments:
                copies.append((qseg_ref.at[batch, q_rows_], qseg_smem2.at[wg]))
            if documents:  # the key tiles wholly inside these rows' document
                copies.append((tiles_ref.at[batch, tile], tiles_smem2.at[wg]))
            for n, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, q_bars.at[n * WARPGROUPS + wg])
            for n in range(len(copies)):
                plgpu.barrier_wait(q_bars.at[n * WARPGROUPS + wg])
            lse2, delta, inv_q, inv_do, q_poison = (_row(rows_smem.at[n]) for n in range(ROWS))
            # S's and dP^'s A operands: this warpgroup's Q and dO tiles, from shared memory
            # in every dot or once into registers ("q": Q, "qdo": both)
            q_operand, do_operand = _register_operands(
                (q_smem, do_smem), ("", "q", "qdo").index(operand_registers), interpret
            )
            q_seg = plgpu.load(qseg_smem2.at[wg], (), layout=ROW) if mask.segments else None
            loaded = [k_bars, v_bars, aux_bars] + [kt_bars] * want_dq
            loaded += [seg_bars] * mask.segments
            # causal: key tiles up to this warpgroup's last row; the first `full` of them
            # end at or before its first row (no mask)
            steps = jnp.minimum(n_k, pl.cdiv(row0 + TILE, key_tile)) if mask.causal else n_k
            full = 0 if every_tile else ((row0 + 1) // key_tile if mask.causal else n_k)
            clean = clean_columns(
                flags_ref, batch, kv_head, flags_smem2.at[wg], q_bars.at[5 * WARPGROUPS + wg]
            )
            full = clean_full(clean, full)  # a bad key: every step masked
            # this warpgroup's key tiles: [lo, steps); then it releases [steps, hi)
            lo, hi = cta_range(tiles_smem2.at[wg] if documents else None, cta_steps)
            steps = jnp.maximum(jnp.minimum(steps, hi), lo)

            def step(j, carry, masked: bool):
                slot = lax.rem(j - lo, stages)
                _wait_all((k_bars, v_bars, aux_bars), slot)
                shape = (TILE, key_tile)
                # the decode factors are repeated along their rows: read the first 64
                inv_k = _row(kvinv_smem.at[slot, 0, pl.ds(0, TILE)])
                inv_v = _row(kvinv_smem.at[slot, 1, pl.ds(0, TILE)])

                def probabilities(s):  # P from S (while the dP^ dot runs, with early_p)
                    # the rows' poison (0 or NaN) joins their factor: one op per score less;
                    # S2 - lse2 is one multiply-add per score
                    s2 = s * _rows((c * inv_q) * inv_k + q_poison, s.shape) - _rows(lse2, s.shape)
                    if mask.segments:  # every step (document tiles' unmasked ones too) waits
                        plgpu.barrier_wait(seg_bars.at[slot])  # for its ids: phases stay paired
                    if masked:
                        k_poison = plgpu.load(kvinv_smem.at[slot, 2], (), layout=COL)
                        s2 = s2 + lax.broadcast_in_dim(k_poison, s.shape, [1])
                        k_seg = None
                        if mask.segments:
                            k_seg = plgpu.load(kseg_smem.at[slot], (), layout=COL)
                        s2 = _masked(mask, s2, row0, j * key_tile, False, (tp, sp), q_seg, k_seg)
                    return jnp.exp2(s2)

                p, dp = _dots_first(
                    ((q_operand, k_smem.at[slot].T), (do_operand, v_smem.at[slot].T)),
                    shape,
                    probabilities,
                    turns.after_issue,
                    early_p,
                )
                dp_factor = inv_do * inv_v  # a power of two
                if not want_dq:  # delta_i += sum_j P_ij dP^_ij, dP^'s factor after the sum
                    plgpu.barrier_arrive(free.at[slot])
                    return carry + dp_factor * (p * dp).sum(axis=1)
                dp = dp * _rows(dp_factor, dp.shape)
                ds = p * (dp - _rows(delta, p.shape))
                ds8, amax = _quantize_ds(ds, red_smem2.at[wg], interpret, ds_rows, masked)
                # (ds8 stays for the statistics: the operand is its regrouped copy)
                a8, amax, carry = turns.arrive((to_operand(ds8), amax, carry))
                plgpu.barrier_wait(kt_bars.at[slot])
                turns.wait()
                a_smem = a_smem2.at[wg] if interpret else None

                def descale(shape):
                    return (sm_scale / _scale(amax, shape)) * _rows(inv_k, shape)

                if chained and n_dq > 1:  # piece n's adds under piece n + 1's dot
                    job = (carry[:n_dq], a8, kt_smem.at[slot], descale)
                    (dq,) = _accumulate_chained([job], interpret, [a_smem])
                else:
                    dq = _accumulate(carry[:n_dq], a8, kt_smem.at[slot], descale, interpret, a_smem)
                plgpu.barrier_arrive(free.at[slot])
                if not with_stats:
                    return dq
                post = ds8.astype(F32) / _scale(amax, ds.shape)  # decoded dS^
                sums = (ds, jnp.abs(ds), post, jnp.abs(post))
                return dq + tuple(acc + x.sum(axis=1) for acc, x in zip(carry[n_dq:], sums))

            row_zeros = plgpu.layout_cast(jnp.zeros((TILE,), F32), ROW)
            if want_dq:
                init = _zero_pieces(cq, pieces) + (row_zeros,) * (4 * with_stats)
            else:
                init = row_zeros
            turns.start()
            if documents:  # masked, unmasked (inside the document), masked
                bounds = (lo, tiles_smem2.at[wg][0], tiles_smem2.at[wg][1], steps)
                bounds = clean_document_bounds(clean, bounds)
                carry = document_loops(step, bounds, init)
            else:
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
                carry = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)

            @pl.loop(steps, hi)  # tiles only the other warpgroup reads: release them
            def _(j):
                slot = lax.rem(j - lo, stages)
                _wait_all(loaded, slot)
                plgpu.barrier_arrive(free.at[slot])
                turns.skip()

            turns.finish()

            if want_dq:
                for n, stat in enumerate(carry[n_dq:]):
                    stats_smem2.at[wg, n][...] = stat
                _store_pieces(  # dQ [B, Tp, Hq, Dqk]
                    carry[:n_dq],
                    [buf.at[wg] for buf in out_smem2],
                    lambda lo, width: out_ref.at[batch, q_rows_, head, pl.ds(lo, width)],
                    out_dtype,
                )
            else:
                out_smem2.at[wg][...] = carry
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem2.at[wg], out_ref.at[batch, head, q_rows_])
            if with_stats:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stats_smem2.at[wg], stats_ref.at[batch, head, :, q_rows_])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == WARPGROUPS)
        def _producer():
            producer_registers()

            def load(j, slot):
                keys = pl.ds(j * key_tile, key_tile)
                at = (batch, kv_head)
                copies = [
                    (k_ref.at[at + (keys,)], k_smem, k_bars),
                    (v_ref.at[at + (keys,)], v_smem, v_bars),
                    (kvinv_ref.at[at + (j,)], kvinv_smem, aux_bars),
                ]
                if want_dq:
                    copies.append((kt_ref.at[at + (pl.ds(dq0, cq), keys)], kt_smem, kt_bars))
                if mask.segments:
                    copies.append((kvseg_ref.at[batch, keys], kseg_smem, seg_bars))
                _copy_to_slot(copies, slot)

            # this CTA's key tiles (with document tiles: its row's lo and hi)
            row = producer_row(tiles_ref, batch, q_tile, tiles_smem2, q_bars.at[6 * WARPGROUPS])
            lo, hi = cta_range(row, cta_steps)
            _stream(load, free, hi - lo, stages, first=lo)

    fp8 = jnp.float8_e4m3fn
    out_shape = (b, tp, hq, cq) if want_dq else (b, hq, tp)
    out_dtype = out_dtype if want_dq else F32

    def dm_fp8_attention_query_pass_mosaic(*refs):  # the kernel's name in profiles
        if want_dq:
            out_smem = _staging(cq, out_dtype, pieces)
        else:
            out_smem = plgpu.SMEM((WARPGROUPS, TILE), F32)
        smem = (
            plgpu.SMEM((WARPGROUPS, TILE, dqk), fp8, transforms=fp8_transforms(dqk)),
            plgpu.SMEM((WARPGROUPS, TILE, dv), fp8, transforms=fp8_transforms(dv)),
            plgpu.SMEM((WARPGROUPS, ROWS, TILE), F32),
            plgpu.SMEM((WARPGROUPS, TILE), jnp.int32) if mask.segments else None,
            out_smem,
            plgpu.SMEM((WARPGROUPS, TILE, key_tile), fp8) if interpret and want_dq else None,
            plgpu.SMEM((WARPGROUPS, 4, TILE), F32) if with_stats else None,
            plgpu.SMEM((WARPGROUPS, REDUCTION_SCRATCH), F32),
            # document tiles: each consumer's row, and the producer's copy of the first
            plgpu.SMEM((WARPGROUPS + 1, doc_tiles.shape[-1]), jnp.int32) if documents else None,
            plgpu.SMEM((stages, key_tile, dqk), fp8, transforms=fp8_transforms(dqk)),
            plgpu.SMEM((stages, key_tile, dv), fp8, transforms=fp8_transforms(dv)),
            plgpu.SMEM((stages, cq, key_tile), fp8, transforms=fp8_transforms(key_tile))
            if want_dq
            else None,
            plgpu.SMEM((stages, 3, key_tile), F32),
            plgpu.SMEM((stages, key_tile), jnp.int32) if mask.segments else None,
            plgpu.SMEM((WARPGROUPS, FLAG_WORDS), jnp.int32),  # the keys' poison flag
        )
        # one copy per barrier (Pallas' GPU interpreter counts one arrival per barrier and copy)
        bars = (
            # Q, dO, row data, segments, document tiles, the poison flag (+ the producer's row)
            plgpu.Barrier(num_barriers=6 * WARPGROUPS + 1),
            plgpu.Barrier(num_barriers=stages),  # K
            plgpu.Barrier(num_barriers=stages),  # V
            plgpu.Barrier(num_barriers=stages),  # K^T
            plgpu.Barrier(num_barriers=stages),  # decode factors
            plgpu.Barrier(num_barriers=stages),  # key segment ids
            plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=stages),  # slot free
            plgpu.Barrier(num_arrivals=WARPGROUPS) if pingpong else None,  # tensor-core turns
        )
        pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, bars, collective_axes="wg")

    args = [q8, do8, q_rows, k8, v8, kv_aux, kv_flags]
    if want_dq:
        args.append(kt8)
    if mask.segments:
        args += [q_seg, kv_seg]
    if documents:
        args.append(doc_tiles)
    out_type = [jax.ShapeDtypeStruct(out_shape, out_dtype)]
    out_type += [jax.ShapeDtypeStruct((b, hq, 4, tp), F32)] * with_stats
    grid, grid_names = (hq, tp // CTA_TOKENS, b), ("heads", "q_seq", "batch")
    outs = warp_specialized_call(
        dm_fp8_attention_query_pass_mosaic, out_type, grid, grid_names, interpret
    )(*args)
    return tuple(outs) if with_stats else outs[0]


def key_pass(
    q8,
    qt8,
    do8,
    dot8,
    q_rows,
    k8,
    v8,
    kv_aux,
    q_flags,
    q_seg=None,
    kv_seg=None,
    *,
    mask: ForwardMask,
    sm_scale: float,
    stages: int,
    out_dtype=jnp.float32,
    interpret: bool = False,
    pingpong: bool = False,
    dk_cols=None,
    dv_cols=None,
    kt8=None,
    unrolled_heads: int = MAX_UNROLLED_HEADS,
    doc_tiles=None,
    pieces=None,
    early_p: bool = False,
    ds_rows: bool = False,
    chained: bool = False,
    operand_registers: str = "",
):
    """dK and dV, summed over each kv head's query heads; with ``kt8`` also dQ's columns
    ``dk_cols``, added into an f32 dQ tile by tile (:func:`_reduce_dq`).

    Args:
      q8 [B, Hq, Tp, Dqk], do8 [B, Hq, Tp, Dv] e4m3 and their permuted K-major copies
        qt8 [B, Hq, Dqk, Tp], dot8 [B, Hq, Dv, Tp].
      q_rows [B, Hq, Tp / 64, 5, 64] f32: per query (lse2, delta, inv_q, inv_do, poison).
      k8 [B, Hkv, Sp, Dqk], v8 [B, Hkv, Sp, Dv] e4m3; kv_aux [B, Hkv, Sp / 64, 3, 64] f32
        as in :func:`query_pass`.
      q_flags [B, Hkv, FLAG_WORDS] int32 (:func:`.forward.poison_flags` of the poisoned
        queries of each kv head's query heads, joined by
        :func:`.backward_ops.ds_range_flags`): where set, every step takes the masked path,
        which adds the queries' poison and casts dS^T with its Inf code.
      q_seg [B, Tp], kv_seg [B, Sp] int32 (only when ``mask.segments``).
      pingpong: the consumer warpgroups take turns on the tensor cores (module docstring).
      dk_cols, dv_cols: (first, count): the columns of dK and of dV this launch forms
        (default all). A count of 0 for dV forms dK alone, one for dK dV alone (no dP^T,
        no dS: S^T and the dV dot only). Alone, either takes up to MAX_HEAD_DIM columns
        (in pieces of ``pieces``: :func:`_accumulate`); together, MAX_COLUMNS each. S^T
        and dP^T always contract the whole head dims; each column's sums are those of a
        launch with every column.
      kt8 [B, Hkv, Dqk, Sp]: K's permuted K-major copy; given, the pass also forms dQ
        (``dk_cols``' columns): dQ_i += (dS^ K8) (sm_scale / s inv_k) per tile, the query
        pass' dot, with dS^ read back transposed (:func:`_transposed_operand`) and each
        tile added to global memory by a TMA reduce-add. Not deterministic: the key
        blocks' adds land in any order.
      unrolled_heads: up to this many query heads per kv head (GQA), each head's loops
        over query tiles follow one another in the kernel's code; more run inside a loop
        over the heads, which carries the dK and dV accumulators around the inner loops and
        makes ptxas spill (bitwise the same results; docs/mosaic_gpu.md, "The GQA key pass").
      doc_tiles: [B, Sp / 64, 32] int32 (segments only; :func:`.documents.key_tiles`): per
        64 keys, the query tiles [first, stop) wholly inside the keys' document (and,
        causal, after them); each head's steps over them take the unmasked path.
      pieces: columns of each fresh dot's accumulator (default MAX_COLUMNS; at most that):
        narrower pieces hold fewer registers beside dK and dV (SEGMENT_PIECES), the same bits.
      early_p, ds_rows: as in :func:`query_pass` (ds_rows: one dS^T scale per key, over the
        tile's 64 queries; not with ``kt8``, whose dQ dot contracts the keys).
      chained: the dV and dK dots' pieces in one chain, each piece's adds while the next
        piece's dot runs (:func:`_accumulate_chained`; the same bits); the step waits for
        dO^T and Q^T before the first.
      operand_registers: ``"k"``: the S^T dot takes K from registers (loaded once per CTA)
        instead of shared memory; ``"kv"``: the dP^T dot V too; ``""``: both from shared
        memory. The same products (GPU only; the interpreter reads shared memory).
    Returns:
      dK [B, Sp, Hkv, dk count], dV [B, Sp, Hkv, dv count] in ``out_dtype`` (the public
      layout), None for a count of 0; with ``kt8`` also dQ [B, Tp, Hq, dk count] f32.
    """
    b, hq, tp, dqk = q8.shape
    hkv, sp, dv = k8.shape[1], k8.shape[2], v8.shape[3]
    (dk0, ck), (dv0, cv) = dk_cols or (0, dqk), dv_cols or (0, dv)
    want_dk, want_dv, want_dq = ck > 0, cv > 0, kt8 is not None
    most = MAX_COLUMNS if want_dk and want_dv else MAX_HEAD_DIM
    if not (want_dk or want_dv) or max(ck, cv) > most or min(ck, cv) < 0:
        raise ValueError(
            f"dk_cols / dv_cols: 0-{MAX_COLUMNS} columns each, or one of them 0 and the "
            f"other up to {MAX_HEAD_DIM}; got {ck}, {cv}"
        )
    if want_dq and not (want_dk and ck <= MAX_COLUMNS):
        raise ValueError(f"kt8 (dQ in the key pass) needs 1-{MAX_COLUMNS} dK columns, got {ck}")
    if want_dq and ds_rows:
        raise ValueError("ds_rows: dQ in the key pass needs one dS^ scale per tile")
    stages = fitting(
        stages, lambda n: key_pass_smem(n, dqk, dv, ck, cv, out_dtype, want_dq, pieces)
    )
    group = hq // hkv
    n_q = tp // TILE
    every_tile = mask.segments or _padded(mask, tp, sp)
    documents = mask.segments and doc_tiles is not None
    c = sm_scale * LOG2E
    to_operand = regroup.operand_fn(interpret)

    def kernel(q_ref, qt_ref, do_ref, dot_ref, rows_ref, k_ref, v_ref, kvinv_ref, flags_ref, *rest):
        rest = list(rest)
        kt_ref = rest.pop(0) if want_dq else None
        qseg_ref, kvseg_ref = (rest.pop(0), rest.pop(0)) if mask.segments else (None, None)
        tiles_ref = rest.pop(0) if documents else None
        dq_ref = rest.pop(0) if want_dq else None  # f32 dQ, zeros before the pass
        dk_ref = rest.pop(0) if want_dk else None
        dv_ref = rest.pop(0) if want_dv else None
        (scratch,) = rest
        smem, bars = scratch
        k_smem2, v_smem2, kvinv_smem, kseg_smem2, outs, a_smem2 = smem[:6]
        # the dK/dV output tiles, written after the loop, share their memory with the
        # dQ tiles' staging, used only inside it
        (dk_smem2, dv_smem2), dq_stage2 = outs if want_dq else (outs, None)
        red_smem2, tiles_smem2 = smem[6:8]
        q_smem, qt_smem, do_smem, dot_smem, rows_smem, qseg_smem, kt_smem2, ds_t_smem2 = smem[8:16]
        flags_smem2 = smem[16]
        kv_bars, q_bars, qt_bars, do_bars, dot_bars, rows_bars, seg_bars, free = bars[:8]
        schedule, dq_done = bars[8:]
        batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
        k_block, wg = lax.axis_index("k_seq"), lax.axis_index("wg")
        turns = _Schedule(schedule, wg)  # both warpgroups step through every query tile

        def query_range(row):
            """(first, per head): the query tiles [first, first + per head) this CTA
            visits for each head: causal, from the first that sees one of its keys;
            with document tiles, within its row's (lo, hi)."""
            first = k_block * WARPGROUPS if mask.causal else 0
            stop = n_q
            if documents:
                first, stop = jnp.maximum(first, row[2]), jnp.minimum(stop, row[3])
            return first, jnp.maximum(stop - first, 0)

        def locate(n, first, per_head):  # flat step -> (query head, query tile)
            g = lax.div(n, per_head)
            return kv_head * group + g, first + n - g * per_head

        @pl.when(wg < WARPGROUPS)
        def _consumer():
            consumer_registers()
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            key0 = k_block * CTA_TOKENS + wg * TILE
            keys = pl.ds(key0, TILE)
            copies = [
                (k_ref.at[batch, kv_head, keys], k_smem),
                (v_ref.at[batch, kv_head, keys], v_smem),
                (kvinv_ref.at[batch, kv_head, k_block * WARPGROUPS + wg], kvinv_smem.at[wg]),
            ]
            if mask.segments:
                copies.append((kvseg_ref.at[batch, keys], kseg_smem2.at[wg]))
            if want_dq:
                copies.append((kt_ref.at[batch, kv_head, pl.ds(dk0, ck), keys], kt_smem2.at[wg]))
            if documents:  # the query tiles wholly inside these keys' document
                copies.append((tiles_ref.at[batch, key0 // TILE], tiles_smem2.at[wg]))
            for n, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, kv_bars.at[n * WARPGROUPS + wg])
            for n in range(len(copies)):
                plgpu.barrier_wait(kv_bars.at[n * WARPGROUPS + wg])
            clean = clean_columns(  # a bad query: every step masked
                flags_ref, batch, kv_head, flags_smem2.at[wg], kv_bars.at[6 * WARPGROUPS + wg]
            )
            inv_k, inv_v = _row(kvinv_smem.at[wg, 0]), _row(kvinv_smem.at[wg, 1])
            k_poison = _row(kvinv_smem.at[wg, 2])
            # S^T's and dP^T's A operands: this warpgroup's K and V tiles, from shared
            # memory in every dot or once into registers ("k": K, "kv": both; V only
            # where dP^T is formed)
            in_registers = min(("", "k", "kv").index(operand_registers), 1 + want_dk)
            k_operand, v_operand = _register_operands((k_smem, v_smem), in_registers, interpret)
            k_seg = plgpu.load(kseg_smem2.at[wg], (), layout=ROW) if mask.segments else None
            first, per_head = query_range(tiles_smem2.at[wg] if documents else None)

            def p_operand(pt):  # (256 P)^T as the dV dot's register operand
                return to_operand(numerics.cast_probabilities(pt, "fp8")) if want_dv else None

            def step(n, carry, masked: bool):
                dk, dv_acc = carry
                slot = lax.rem(n, stages)
                head, i = locate(n, first, per_head)
                _wait_all((q_bars, rows_bars) + (do_bars,) * want_dk, slot)
                pairs = ((k_operand, q_smem.at[slot].T),)
                if want_dk:
                    pairs += ((v_operand, do_smem.at[slot].T),)
                rows = rows_smem.at[slot]
                inv_q, inv_do = _row(rows.at[2]), _row(rows.at[3])

                def probabilities(st):  # P^T (and its operand) while the dP^T dot runs
                    lse2 = plgpu.load(rows.at[0], (), layout=COL)
                    # query_pass' S2 - lse2 bit for bit but the sign of a zero (which exp2
                    # ignores): the same multiply-add, NaN where either poison is
                    s2 = st * _rows((c * inv_q) * inv_k + k_poison, st.shape)
                    s2 = s2 - lax.broadcast_in_dim(lse2, st.shape, [1])
                    if mask.segments:  # every step (document tiles' unmasked ones too) waits
                        plgpu.barrier_wait(seg_bars.at[slot])  # for its ids: phases stay paired
                    if masked:
                        q_poison = plgpu.load(rows.at[4], (), layout=COL)
                        s2 = s2 + lax.broadcast_in_dim(q_poison, st.shape, [1])
                        q_seg = None
                        if mask.segments:
                            q_seg = plgpu.load(qseg_smem.at[slot], (), layout=COL)
                        s2 = _masked(mask, s2, i * TILE, key0, True, (tp, sp), q_seg, k_seg)
                    pt = jnp.exp2(s2)
                    # early: the dV dot's operand too, before the dP^T dot is waited for
                    return pt, (p_operand(pt) if early_p else None)

                (pt, p8), *dpt = _dots_first(
                    pairs, (TILE, TILE), probabilities, turns.after_issue, early_p
                )
                ds8t = ds8 = amax = None
                if want_dk:
                    delta = plgpu.load(rows.at[1], (), layout=COL)
                    dpt = dpt[0] * _rows(inv_do * inv_v, pt.shape)
                    dst = pt * (dpt - lax.broadcast_in_dim(delta, pt.shape, [1]))
                    ds8t, amax = _quantize_ds(dst, red_smem2.at[wg], interpret, ds_rows, masked)
                    ds8 = to_operand(ds8t)
                if not early_p:
                    p8 = p_operand(pt)
                p8, ds8, amax, dk, dv_acc = turns.arrive((p8, ds8, amax, dk, dv_acc))
                a_smem = a_smem2.at[wg, 0] if interpret else None
                chain = chained and want_dk and want_dv  # dV's adds under dK's dots
                if want_dv:
                    plgpu.barrier_wait(dot_bars.at[slot])
                if chain:  # both register dots' operands before either issues
                    plgpu.barrier_wait(qt_bars.at[slot])
                turns.wait()

                def dv_scale(shape):
                    return _rows(inv_do * (1.0 / numerics.P_SCALE), shape)

                def dk_scale(shape):  # dS^'s descale (for dK and dQ alike) and Q's
                    return (sm_scale / _scale(amax, shape)) * _rows(inv_q, shape)

                if chain:
                    dv_acc, dk = _accumulate_chained(
                        [
                            (dv_acc, p8, dot_smem.at[slot], dv_scale),
                            (dk, ds8, qt_smem.at[slot], dk_scale),
                        ],
                        interpret,
                        [a_smem2.at[wg, 0], a_smem2.at[wg, 1]] if interpret else None,
                    )
                    plgpu.barrier_arrive(free.at[slot])
                else:
                    if want_dv:
                        dv_acc = _accumulate(
                            dv_acc, p8, dot_smem.at[slot], dv_scale, interpret, a_smem
                        )
                    if not want_dk:
                        plgpu.barrier_arrive(free.at[slot])
                        return dk, dv_acc
                    plgpu.barrier_wait(qt_bars.at[slot])
                    dk = _accumulate(dk, ds8, qt_smem.at[slot], dk_scale, interpret, a_smem)
                    plgpu.barrier_arrive(free.at[slot])
                if want_dq:
                    shape = (TILE, ck)
                    descale = sm_scale / _scale(amax, shape)
                    ds8 = _transposed_operand(ds8t, ds_t_smem2.at[wg], to_operand)
                    part = _register_dot(ds8, kt_smem2.at[wg].T, (TILE, ck), interpret, a_smem)
                    part = part * (descale * _rows(inv_k, shape))
                    dq_tile = dq_ref.at[_dq_block(k_block, wg, interpret), batch]
                    rows_ = pl.ds(i * TILE, TILE)
                    _reduce_dq(part, dq_stage2.at[wg], dq_tile.at[rows_, head], interpret)
                return dk, dv_acc

            if documents:  # this head's steps over the document tiles, from `first`
                doc_lo = jnp.clip(tiles_smem2.at[wg][0] - first, 0, per_head)
                doc_hi = jnp.clip(tiles_smem2.at[wg][1] - first, doc_lo, per_head)

            def head_steps(g, carry):
                # causal (no padding, no segments): the first two query tiles of each head
                # cross the diagonal of this CTA's keys; every later one sees all of them
                lo = g * per_head
                if documents:  # masked, unmasked (inside the document), masked
                    bounds = (lo, lo + doc_lo, lo + doc_hi, lo + per_head)
                    return document_loops(step, clean_document_bounds(clean, bounds), carry)
                if every_tile:
                    mid = lo + per_head
                elif mask.causal:
                    mid = lo + jnp.minimum(WARPGROUPS, per_head)
                else:
                    mid = lo
                mid = jnp.where(clean, mid, lo + per_head)
                carry = lax.fori_loop(lo, mid, functools.partial(step, masked=True), carry)
                return lax.fori_loop(
                    mid, lo + per_head, functools.partial(step, masked=False), carry
                )

            turns.start()
            init = tuple(_zero_pieces(n, pieces) if n else None for n in (ck, cv))
            if group <= unrolled_heads:  # one after the other: no loop around the loops
                carry = init
                for g in range(group):
                    carry = head_steps(g, carry)
                dk, dv_acc = carry
            else:
                dk, dv_acc = lax.fori_loop(0, group, head_steps, init)
            turns.finish()
            if want_dq:
                # the output tiles reuse the dQ staging of both warpgroups (one's dV tile
                # lies on the other's staging): both finish their last reduce's reads first
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(dq_done)
                plgpu.barrier_wait(dq_done)
            for acc, bufs, out_ref in ((dk, dk_smem2, dk_ref), (dv_acc, dv_smem2, dv_ref)):
                if acc is not None:  # [B, Sp, Hkv, D]
                    _store_pieces(
                        acc,
                        [buf.at[wg] for buf in bufs],
                        lambda lo, width, r=out_ref: r.at[batch, keys, kv_head, pl.ds(lo, width)],
                        out_dtype,
                    )
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == WARPGROUPS)
        def _producer():
            producer_registers()

            # this CTA's query tiles (with document tiles: its row's lo and hi)
            first, per_head = query_range(
                producer_row(tiles_ref, batch, k_block, tiles_smem2, kv_bars.at[7 * WARPGROUPS])
            )

            def load(n, slot):
                head, i = locate(n, first, per_head)
                rows = pl.ds(i * TILE, TILE)
                at = (batch, head)
                copies = [
                    (q_ref.at[at + (rows,)], q_smem, q_bars),
                    (rows_ref.at[at + (i,)], rows_smem, rows_bars),
                ]
                if want_dk:
                    copies.append((do_ref.at[at + (rows,)], do_smem, do_bars))
                if want_dv:
                    copies.append((dot_ref.at[at + (pl.ds(dv0, cv), rows)], dot_smem, dot_bars))
                if want_dk:
                    copies.append((qt_ref.at[at + (pl.ds(dk0, ck), rows)], qt_smem, qt_bars))
                if mask.segments:
                    copies.append((qseg_ref.at[batch, rows], qseg_smem, seg_bars))
                _copy_to_slot(copies, slot)

            _stream(load, free, group * per_head, stages)

    fp8 = jnp.float8_e4m3fn
    segs = mask.segments

    def dm_fp8_attention_key_pass_mosaic(*refs):  # the kernel's name in profiles
        outs = (
            _staging(ck, out_dtype, pieces) if want_dk else None,
            _staging(cv, out_dtype, pieces) if want_dv else None,
        )
        if want_dq:
            stage = plgpu.SMEM((WARPGROUPS, TILE, ck), F32, transforms=out_transforms(F32))
            outs = plgpu.RefUnion(outs, stage)
        smem = (
            plgpu.SMEM((WARPGROUPS, TILE, dqk), fp8, transforms=fp8_transforms(dqk)),
            plgpu.SMEM((WARPGROUPS, TILE, dv), fp8, transforms=fp8_transforms(dv)),
            plgpu.SMEM((WARPGROUPS, 3, TILE), F32),
            plgpu.SMEM((WARPGROUPS, TILE), jnp.int32) if segs else None,
            outs,
            # the interpreter's register operands (P^T and dS^T: both, chained)
            plgpu.SMEM((WARPGROUPS, 2, TILE, TILE), fp8) if interpret else None,
            plgpu.SMEM((WARPGROUPS, REDUCTION_SCRATCH), F32),
            # document tiles: each consumer's row, and the producer's copy of the first
            plgpu.SMEM((WARPGROUPS + 1, doc_tiles.shape[-1]), jnp.int32) if documents else None,
            plgpu.SMEM((stages, TILE, dqk), fp8, transforms=fp8_transforms(dqk)),
            plgpu.SMEM((stages, ck, TILE), fp8, transforms=fp8_transforms(TILE))
            if want_dk
            else None,
            plgpu.SMEM((stages, TILE, dv), fp8, transforms=fp8_transforms(dv)) if want_dk else None,
            plgpu.SMEM((stages, cv, TILE), fp8, transforms=fp8_transforms(TILE))
            if want_dv
            else None,
            plgpu.SMEM((stages, ROWS, TILE), F32),
            plgpu.SMEM((stages, TILE), jnp.int32) if segs else None,
            # dQ: this warpgroup's K^T tile, and dS^'s transpose in 16 bits
            plgpu.SMEM((WARPGROUPS, ck, TILE), fp8, transforms=fp8_transforms(TILE))
            if want_dq
            else None,
            plgpu.SMEM((WARPGROUPS, TILE, TILE), F16, transforms=out_transforms(F16))
            if want_dq
            else None,
            plgpu.SMEM((WARPGROUPS, FLAG_WORDS), jnp.int32),  # the queries' poison flag
        )
        # one copy per barrier (Pallas' GPU interpreter counts one arrival per barrier and copy)
        bars = (
            # K, V, factors and poison, segments, K^T, document tiles, the poison flag (+ the
            # producer's row)
            plgpu.Barrier(num_barriers=7 * WARPGROUPS + 1),
            plgpu.Barrier(num_barriers=stages),  # Q
            plgpu.Barrier(num_barriers=stages),  # Q^T
            plgpu.Barrier(num_barriers=stages),  # dO
            plgpu.Barrier(num_barriers=stages),  # dO^T
            plgpu.Barrier(num_barriers=stages),  # row data
            plgpu.Barrier(num_barriers=stages),  # query segment ids
            plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=stages),  # slot free
            plgpu.Barrier(num_arrivals=WARPGROUPS) if pingpong else None,  # tensor-core turns
            plgpu.Barrier(num_arrivals=WARPGROUPS) if want_dq else None,  # dQ staging done
        )
        pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, bars, collective_axes="wg")

    args = [q8, qt8, do8, dot8, q_rows, k8, v8, kv_aux, q_flags]
    args += [kt8] if want_dq else []
    if segs:
        args += [q_seg, kv_seg]
    if documents:
        args.append(doc_tiles)
    if want_dq:  # zeros, added into; in the interpreter one partial dQ per warpgroup's keys
        blocks = sp // TILE if interpret else 1
        dq = jax.new_ref(jnp.zeros((blocks, b, tp, hq, ck), F32))
        args.append(dq)
    out_type = [jax.ShapeDtypeStruct((b, sp, hkv, ck), out_dtype)] * want_dk
    out_type += [jax.ShapeDtypeStruct((b, sp, hkv, cv), out_dtype)] * want_dv
    grid, grid_names = (hkv, sp // CTA_TOKENS, b), ("heads", "k_seq", "batch")
    outs = warp_specialized_call(
        dm_fp8_attention_key_pass_mosaic, out_type, grid, grid_names, interpret
    )(*args)
    outs = list(outs)
    dk = outs.pop(0) if want_dk else None
    dv_out = outs.pop(0) if want_dv else None
    if want_dq:
        return dk, dv_out, dq[...].sum(axis=0)
    return dk, dv_out


def column_pieces(d: int, width=None) -> list[tuple[int, int]]:
    """(first, count) of the accumulator pieces of ``d`` columns: one up to ``width``
    (default MAX_COLUMNS), else pieces of ``width`` and the rest (256 by 128: two of 128;
    192: 128 and 64). Each piece is one fresh accumulator of a launch's dot
    (:func:`_accumulate`)."""
    width = width or MAX_COLUMNS
    return [(lo, min(width, d - lo)) for lo in range(0, d, width)]


def column_chunks(d: int) -> list[tuple[int, int]]:
    """(first, count) of each launch's accumulator columns for head dim ``d`` with
    ``wide="per_chunk"``: one launch per :func:`column_pieces` piece."""
    return column_pieces(d)


WIDE_LAUNCHES = ("per_chunk", "per_gradient")


def key_pass_launches(
    dqk: int, dv: int, wide: str = "per_gradient"
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(dk_cols, dv_cols) of each key-pass launch. Head dims up to MAX_COLUMNS: one launch
    of both. Wider, ``wide="per_chunk"``: the n-th dK chunk with the n-th dV chunk, or with
    (0, 0) (dK alone) once dV's chunks are used up (192/128's second launch; needs no more
    dV chunks than dK chunks, ``backward_ops.reason`` checks); ``"per_gradient"``: dV alone
    (S^T and the dV dot), then dK alone, each over all its columns in MAX_COLUMNS pieces,
    so the dS math and dP^T run once per tile instead of once per chunk."""
    if wide not in WIDE_LAUNCHES:
        raise ValueError(f"wide must be one of {WIDE_LAUNCHES}, got {wide!r}")
    if max(dqk, dv) <= MAX_COLUMNS:
        return [((0, dqk), (0, dv))]
    if wide == "per_gradient":
        return [((0, 0), (0, dv)), ((0, dqk), (0, 0))]
    dv_chunks = column_chunks(dv)
    dk_chunks = column_chunks(dqk)
    return list(zip(dk_chunks, dv_chunks + [(0, 0)] * (len(dk_chunks) - len(dv_chunks))))


def query_pass_launches(dqk: int, wide: str = "per_gradient") -> list[tuple[int, int]]:
    """dq_cols of each dQ-pass launch: all columns in one (``"per_gradient"``, in
    MAX_COLUMNS pieces), or one launch per :func:`column_chunks` chunk."""
    return [(0, dqk)] if wide == "per_gradient" else column_chunks(dqk)


def key_pass_smem(
    stages: int,
    dqk: int,
    dv: int,
    ck: int,
    cv: int,
    out_dtype,
    with_dq: bool = False,
    pieces=None,
) -> int:
    """Shared memory of a key-pass CTA forming ck columns of dK and cv of dV: K, V and the
    output staging per consumer warpgroup, Q, Q^T's ck rows, dO (with dK), dO^T's cv rows
    per stage. ``with_dq``: also K^T's ck rows and the 16-bit dS^ transpose per warpgroup,
    and the f32 dQ staging where it outgrows the output tiles it shares memory with."""
    out = jnp.dtype(out_dtype).itemsize
    outs = sum(_staging_bytes(cols, out, pieces) for cols in (ck, cv) if cols)
    if with_dq:
        outs = max(outs, TILE * ck * 4) + ck * TILE + TILE * TILE * 2
    per_wg = TILE * (dqk + dv) + outs + 3 * TILE * 4 + TILE * TILE
    per_wg += REDUCTION_SCRATCH * 4
    per_stage = TILE * (dqk + (dv if ck else 0)) + (ck + cv) * TILE + ROWS * TILE * 4 + TILE * 4
    return WARPGROUPS * per_wg + stages * per_stage + 4096


def dq_in_key_pass_fits(dqk: int, dv: int, out_dtype) -> bool:
    """Whether every key-pass launch fits shared memory with dQ in it, one stage at least
    (not with f32 gradients at head dims 128 and 192/128, nor at 256)."""
    return all(
        key_pass_smem(1, dqk, dv, ck, cv, out_dtype, with_dq=True) <= SMEM_BYTES
        for (_, ck), (_, cv) in key_pass_launches(dqk, dv, "per_chunk")
    )


def query_pass_smem(
    stages: int, dqk: int, dv: int, cq: int, key_tile: int, out_dtype, pieces=None
) -> int:
    """Shared memory of a query-pass CTA (cq columns of dQ; 0 for the delta pass): Q, dO,
    the row data and the output tile per consumer warpgroup, K, V, K^T's cq rows per stage."""
    out = jnp.dtype(out_dtype).itemsize
    staging = _staging_bytes(cq, out, pieces) if cq else TILE * 4
    per_wg = TILE * (dqk + dv) + ROWS * TILE * 4 + staging + 4 * TILE * 4
    per_wg += TILE * TILE + REDUCTION_SCRATCH * 4
    per_stage = key_tile * (dqk + dv + cq) + 3 * key_tile * 4 + key_tile * 4
    return WARPGROUPS * per_wg + stages * per_stage + 4096


def smem_fits(
    dqk: int, dv: int, out_dtype, wide: str = "per_gradient", dq_key_tile: int = TILE
) -> bool:
    """Whether every pass fits shared memory with one stage at least (each pass runs the
    most stages up to the config's that fit), the dQ pass stepping ``dq_key_tile`` keys."""
    launches = key_pass_launches(dqk, dv, wide)
    key = max(key_pass_smem(1, dqk, dv, ck, cv, out_dtype) for (_, ck), (_, cv) in launches)
    query = max(
        query_pass_smem(1, dqk, dv, cq, dq_key_tile, out_dtype)
        for _, cq in query_pass_launches(dqk, wide)
    )
    delta = query_pass_smem(1, dqk, dv, 0, BLOCK, out_dtype)
    return max(key, query, delta) <= SMEM_BYTES


__all__ = [
    "BLOCK",
    "MAX_COLUMNS",
    "MAX_HEAD_DIM",
    "TILE",
    "column_chunks",
    "column_pieces",
    "dq_in_key_pass_fits",
    "key_pass",
    "key_pass_launches",
    "query_pass_launches",
    "query_pass",
    "smem_fits",
]
