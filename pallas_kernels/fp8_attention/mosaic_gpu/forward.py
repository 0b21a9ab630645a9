"""Mosaic GPU forward kernel: FA3-style warp specialization, both dots in FP8 e4m3.

One CTA per (query head, 128 query rows, batch): two consumer warpgroups of 64 query rows
each and one producer warpgroup that streams K tiles [128, Dqk], V^T tiles [Dv, 128]
and their decode factors into a ring of shared-memory stages with TMA.

Per key tile j (128 keys: one scale block, so one K and one V decode factor), in log2
units (c = sm_scale * log2(e)), for the 64 rows of a consumer warpgroup:
    S2   = (Q8 K8_j^T) * (c inv_q inv_k_j) + poison_j      wgmma, A = Q from shared memory
    S2   = -inf where masked (causal, segments, padded keys)
    m'   = max(m, rowmax S2);   alpha = 2^(m - m')
    P256 = 2^(S2 - m' + 8)      (= 256 P: P's fixed FP8 scale folded into the exponent)
    l    = alpha l + rowsum P256
    acc  = alpha acc + (P256^ V8_j) * inv_v_j             wgmma, A = P^ from registers
    O = acc / l,   lse = (m + log2(l) - 8) ln 2   (rows that see no key: O = 0, lse = +inf)
P256 is cast to e4m3 in registers and regrouped into the 8-bit operand layout
(:mod:`.regroup`); V^T arrives with its tokens permuted to match. Tokens whose Q, K or V row
held a non-finite value arrive zeroed, with NaN in inv_q (bad queries) or in the per-key
``poison`` (bad keys or values, else 0): NaN reaches exactly the visible pairs. The poison
is added on masked steps only; a CTA whose kv head holds a bad key (:func:`poison_flags`)
takes every step masked. An unmasked step takes the row max on the raw scores
(max_j S_ij f_i = f_i max_j S_ij for f_i > 0, bit for bit) and forms S2 - m' + 8 in one
multiply-add per score.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_attention.mosaic_gpu import regroup
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import BLOCK, ROWS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
P_EXPONENT = 8.0  # log2 of P's fixed scale 256
WARPGROUPS = 2  # consumer warpgroups per CTA
# registers per thread of a consumer and of the producer warpgroup (setmaxnreg): the CTA's
# 384 threads start with 168 each (64,512 of the SM's 65,536), which 2 x 128 x 240 +
# 128 x 24 fills (FlashAttention-3's split). Against 232 / 40 (the split until
# 2026-12-07) it took the D=128 key pass 1,609 -> 1,531 us and all kernels of a fwd+bwd
# 3,984 -> 3,876 us on an H100, bitwise the same (docs/mosaic_gpu.md, "240 registers")
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24


@dataclasses.dataclass(frozen=True)
class ForwardMask:
    """Static mask settings: real lengths, causality, segments."""

    t: int
    s: int
    causal: bool
    segments: bool


def fp8_transforms(cols: int):
    """Shared-memory tiling + swizzle of an e4m3 tile whose rows hold ``cols`` bytes."""
    swizzle = 128 if cols % 128 == 0 else 64
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def out_transforms(dtype):
    """Tiling + swizzle of an output tile (128-byte rows)."""
    per_row = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, per_row)), plgpu.SwizzleTransform(128))


SMEM_BYTES = 232_448  # per CTA on the H200 (HOPPER_FP8.md)
OUT_CHUNK = 128  # O columns per store when the whole O tile would cost a K/V stage


def kernel_dtype(dtype):
    """The dtype a kernel writes for inputs of ``dtype``: bf16, f16 or f32 (others: f32;
    the cast to the input's dtype follows)."""
    return dtype if dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.float32


INTERPRETER_THREADS = 8  # XLA CPU threads the GPU interpreter needs (WARPGROUPS + 1 wait)


def interpreter_threads() -> int:
    """The CPU threads XLA's CPU client starts with: ``NPROC`` if set, else the cores."""
    return int(os.environ.get("NPROC") or 0) or os.cpu_count() or 1


@functools.cache
def warn_interpreter_threads():
    """Warn (once) where XLA's CPU client likely has too few threads for Pallas' GPU
    interpreter: each simulated warpgroup's barrier wait holds one, and a kernel whose
    warpgroups all wait at once never finishes (docs/mosaic_gpu.md, "The CPU twin")."""
    threads = interpreter_threads()
    if threads < INTERPRETER_THREADS:
        warnings.warn(
            f"Pallas' GPU interpreter may wait forever with {threads} CPU threads (kernels "
            f"with segment ids or causal GQA); set NPROC={INTERPRETER_THREADS} in the "
            "environment before the first computation (XLA reads it when its CPU client starts)",
            RuntimeWarning,
            stacklevel=3,
        )


def warp_specialized_call(body, out_type, grid, grid_names, interpret: bool):
    """``plgpu.kernel`` with WARPGROUPS consumer warpgroups and one producer warpgroup
    (thread axis "wg"), fast approximate math, or Pallas' GPU interpret mode (threads,
    barriers, TMA and wgmma simulated on the CPU)."""
    if interpret:
        warn_interpreter_threads()
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )


def query_tile(n_tiles: int, longest_first: bool):
    """This CTA's query tile along the grid's "q_seq" axis. In a causal pass query tile i
    sees i + 1 key tiles; ``longest_first`` launches the last tile first, so the long CTAs
    start early and the short ones fill the end of the launch (FlashAttention-3's causal
    order). Only the launch order changes: each tile's work and results are the same."""
    i = lax.axis_index("q_seq")
    return n_tiles - 1 - i if longest_first else i


def document_loops(step, bounds, carry):
    """``step(j, carry, masked=...)`` over [b0, b1) masked, [b1, b2) unmasked, [b2, b3)
    masked (``bounds``: a loop's range [b0, b3) split by its document tiles [b1, b2),
    :mod:`.documents`; b1 and b2 are clipped into the range, so every step runs once)."""
    first, mid0, mid1, last = bounds
    mid0 = jnp.clip(mid0, first, jnp.maximum(first, last))
    mid1 = jnp.clip(mid1, mid0, jnp.maximum(mid0, last))
    bounds = (first, mid0, mid1, last)
    for lo, hi, masked in zip(bounds, bounds[1:], (True, False, True)):
        carry = lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
    return carry


def cta_range(row, steps):
    """(lo, hi): the tiles a CTA steps over, [0, ``steps``) or, with its bounds row
    (:mod:`.documents`), the part of it inside the row's (lo, hi)."""
    if row is None:
        return 0, steps
    lo = jnp.minimum(row[2], steps)
    return lo, jnp.maximum(jnp.minimum(row[3], steps), lo)


def producer_row(tiles_ref, batch, cta, tiles_smem, barrier):
    """The producer's copy of its CTA's bounds row (:mod:`.documents`: the first of the
    CTA's two rows, whose (lo, hi) both share), in the last row of ``tiles_smem``; None
    without document tiles (``tiles_ref`` None)."""
    if tiles_ref is None:
        return None
    row = tiles_smem.at[WARPGROUPS]
    plgpu.copy_gmem_to_smem(tiles_ref.at[batch, cta * WARPGROUPS], row, barrier)
    plgpu.barrier_wait(barrier)
    return row


FLAG_WORDS = 32  # int32 per row of poison flags: 128 bytes, a TMA copy's alignment


def poison_flags(bad_BHT, group: int = 1):
    """[B, H / group, FLAG_WORDS] int32: 1 where any token of a (batch, head) row, over
    ``group`` consecutive heads, is bad (its poison is NaN), else 0. A kernel's steps add
    the poison of their tiles' columns only where they are masked anyway or this flag is
    set (:func:`clean_columns`)."""
    b, h, t = bad_BHT.shape
    any_bad = jnp.any(bad_BHT.reshape(b, h // group, group * t), axis=-1).astype(jnp.int32)
    return jnp.broadcast_to(any_bad[..., None], any_bad.shape + (FLAG_WORDS,))


def clean_columns(flags_ref, batch, head, flag_smem, barrier):
    """Whether no token on the column side of this CTA's tiles (keys in the forward and the
    query passes, queries in the key pass) is bad: then its unmasked steps need not add
    their poison (one op per score less, and S2 - lse2 one multiply-add). Else every step
    takes the masked path, which adds it: the same values either way."""
    plgpu.copy_gmem_to_smem(flags_ref.at[batch, head], flag_smem, barrier)
    plgpu.barrier_wait(barrier)
    return flag_smem[0] == 0


def clean_full(clean, full):
    """The end of the unmasked steps [0, full): ``full``, or 0 where ``clean`` is False."""
    return jnp.where(clean, full, 0)


def clean_document_bounds(clean, bounds):
    """document_loops' four bounds, or where ``clean`` is False bounds with no unmasked
    step (every step in the first masked loop)."""
    first, mid0, mid1, last = bounds
    return first, jnp.where(clean, mid0, last), jnp.where(clean, mid1, last), last


def smem_bytes(stages: int, dqk: int, dv: int, out_dtype, out_cols=None) -> int:
    """Shared memory of one CTA: Q and O tiles per consumer warpgroup (O ``out_cols`` wide,
    default ``dv``), K / V^T stages."""
    out_cols = dv if out_cols is None else out_cols
    # + document tiles and poison flags
    per_wg = ROWS * (dqk + out_cols * jnp.dtype(out_dtype).itemsize + 12) + 2 * 128
    per_stage = BLOCK * (dqk + dv) + 2 * ROWS * 4 + 2 * BLOCK * 4  # + the aux row
    return WARPGROUPS * per_wg + stages * per_stage + 4096  # + barriers, alignment (measured)


def consumer_registers():
    """A consumer warpgroup's register budget (the module's CONSUMER_REGISTERS, read at
    trace time)."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")


def producer_registers():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")


def fitting(stages: int, smem) -> int:
    """The most stages <= ``stages`` for which ``smem(stages)`` bytes fit, at least 1."""
    while stages > 1 and smem(stages) > SMEM_BYTES:
        stages -= 1
    return stages


def stages_and_out_cols(stages: int, n_k: int, dqk: int, dv: int, out_dtype) -> tuple:
    """(K/V stages, O columns per store): the most stages <= ``stages`` (and <= the key
    tiles) that fit in shared memory, with the whole O tile, or with O stored OUT_CHUNK
    columns at a time where that fits more stages (D=256 in bf16: two stages instead of one).
    """
    want = max(1, min(stages, n_k))
    whole = fitting(want, lambda n: smem_bytes(n, dqk, dv, out_dtype))
    if whole < want and dv > OUT_CHUNK and dv % OUT_CHUNK == 0:
        chunked = fitting(want, lambda n: smem_bytes(n, dqk, dv, out_dtype, OUT_CHUNK))
        if chunked > whole:
            return chunked, OUT_CHUNK
    return whole, dv


def forward(
    q8,
    q_inv,
    k8,
    vt8,
    kv_aux,
    kv_flags,
    q_seg=None,
    kv_seg=None,
    *,
    mask: ForwardMask,
    sm_scale: float,
    stages: int,
    out_dtype,
    interpret: bool = False,
    out_cols=None,
    longest_first: bool = False,
    doc_tiles=None,
):
    """Run the forward kernel on quantized, padded operands.

    Args:
      q8: [B, Hq, Tp, Dqk] e4m3; q_inv: [B, Hq, Tp] f32 decode factor per query.
      k8: [B, Hkv, Sp, Dqk] e4m3; vt8: [B, Hkv, Dv, Sp] e4m3, tokens permuted per 16.
      kv_aux: [B, Hkv, Sp / 128, 256] f32, per key block: K's and V's decode factors, each
        repeated over 64 rows, then the keys' poison (NaN for a key whose K or V row was not
        finite, else 0): one copy per tile.
      kv_flags: [B, Hkv, FLAG_WORDS] int32 (:func:`poison_flags` of the bad keys): 1 where
        a (batch, kv head) has a bad key.
      q_seg [B, Tp], kv_seg [B, Sp]: int32 segment ids (only when ``mask.segments``).
      out_cols: O columns per shared-memory store (a divisor of Dv of 128-byte rows);
        default :func:`stages_and_out_cols`'s choice.
      longest_first: causal only: the query tiles that see the most keys launch first
        (:func:`query_tile`).
      doc_tiles: [B, Tp / 64, 32] int32 (segments only; :func:`.documents.query_tiles`
        with 128-key tiles): per 64 query rows, the key tiles [first, stop) that lie wholly
        inside the rows' document (they take the unmasked path) and the key tiles [lo, hi)
        their CTA visits (the others are wholly masked): the same results.
    Returns:
      o [B, Tp, Hq, Dv] in ``out_dtype`` (the public layout: no transpose after the kernel),
      lse [B, Hq, Tp] f32 (natural log).
    """
    b, hq, tp, dqk = q8.shape
    hkv, sp = k8.shape[1], k8.shape[2]
    dv = vt8.shape[2]
    group = hq // hkv
    n_k = sp // BLOCK
    stages, chosen_cols = stages_and_out_cols(stages, n_k, dqk, dv, out_dtype)
    if out_cols is None:
        out_cols = chosen_cols
    elif dv % out_cols or (out_cols * jnp.dtype(out_dtype).itemsize) % 128:
        raise ValueError(f"out_cols must divide Dv={dv} in 128-byte rows, got {out_cols}")
    c = sm_scale * LOG2E
    block_q = WARPGROUPS * ROWS

    to_operand = regroup.operand_fn(interpret)

    documents = mask.segments and doc_tiles is not None

    def kernel(q_ref, qinv_ref, k_ref, vt_ref, kvinv_ref, flags_ref, *rest):
        rest = list(rest)
        qseg_ref, kvseg_ref = (rest.pop(0), rest.pop(0)) if mask.segments else (None, None)
        tiles_ref = rest.pop(0) if documents else None
        o_ref, lse_ref, scratch = rest
        smem, barriers = scratch
        (
            q_smem2,
            o_smem2,
            lse_smem2,
            qinv_smem2,
            qseg_smem2,
            k_smem,
            vt_smem,
            kvinv_smem,
            kseg_smem,
            p_smem2,
            tiles_smem2,
            flags_smem2,
        ) = smem
        q_bars, k_bars, v_bars, aux_bars, k_free, v_free, schedule = barriers
        batch, head = lax.axis_index("batch"), lax.axis_index("heads")
        q_tile = query_tile(tp // block_q, mask.causal and longest_first)
        wg = lax.axis_index("wg")
        kv_head = lax.div(head, jnp.array(group, head.dtype))
        if mask.causal:
            cta_steps = jnp.minimum(n_k, pl.cdiv((q_tile + 1) * block_q, BLOCK))
        else:
            cta_steps = n_k

        def schedule_barrier():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when(wg < WARPGROUPS)
        def _consumer():
            consumer_registers()
            q_smem, o_smem, lse_smem = q_smem2.at[wg], o_smem2.at[wg], lse_smem2.at[wg]
            row0 = q_tile * block_q + wg * ROWS
            rows = pl.ds(row0, ROWS)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, head, rows], q_smem, q_bars.at[wg])
            plgpu.copy_gmem_to_smem(
                qinv_ref.at[batch, head, rows], qinv_smem2.at[wg], q_bars.at[WARPGROUPS + wg]
            )
            if mask.segments:
                plgpu.copy_gmem_to_smem(
                    qseg_ref.at[batch, rows], qseg_smem2.at[wg], q_bars.at[2 * WARPGROUPS + wg]
                )
                plgpu.barrier_wait(q_bars.at[2 * WARPGROUPS + wg])
                q_seg = plgpu.load(qseg_smem2.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
            if documents:  # the key tiles wholly inside these rows' document
                tiles = tiles_smem2.at[wg]
                plgpu.copy_gmem_to_smem(
                    tiles_ref.at[batch, row0 // ROWS], tiles, q_bars.at[3 * WARPGROUPS + wg]
                )
                plgpu.barrier_wait(q_bars.at[3 * WARPGROUPS + wg])
            lo, hi = cta_range(tiles if documents else None, cta_steps)
            clean = clean_columns(
                flags_ref, batch, kv_head, flags_smem2.at[wg], q_bars.at[4 * WARPGROUPS + wg]
            )
            plgpu.barrier_wait(q_bars.at[WARPGROUPS + wg])
            row_scale = plgpu.load(qinv_smem2.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1)) * c
            plgpu.barrier_wait(q_bars.at[wg])

            if mask.causal:
                steps = jnp.minimum(n_k, pl.cdiv(row0 + ROWS, BLOCK))
                full = jnp.minimum(row0 // BLOCK, mask.s // BLOCK)
            else:
                steps = n_k
                full = mask.s // BLOCK
            if mask.segments:
                full = jnp.zeros_like(steps)
            full = clean_full(clean, jnp.minimum(full, steps))
            # this warpgroup's key tiles: [lo, steps); then it releases [steps, hi)
            steps = jnp.maximum(jnp.minimum(steps, hi), lo)

            m = plgpu.layout_cast(
                jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            )
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, dv), jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(steps > lo)
            def _():
                plgpu.barrier_wait(k_bars.at[0])

            pl.when(wg == 1)(schedule_barrier)

            def step(j, carry, masked: bool):
                acc, m, l, u = carry
                slot = lax.rem(j - lo, stages)

                def qk(acc_ref):  # Q8 K8^T, K K-major
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK), jnp.float32))
                plgpu.barrier_wait(aux_bars.at[slot])
                aux = kvinv_smem.at[slot]
                inv_k = plgpu.load(aux.at[pl.ds(0, ROWS)], (), layout=plgpu.Layout.WGMMA.reduce(1))
                inv_v = plgpu.load(
                    aux.at[pl.ds(ROWS, ROWS)], (), layout=plgpu.Layout.WGMMA.reduce(1)
                )
                k_poison = None
                if masked:  # (only masked steps add the keys' poison)
                    k_poison = plgpu.load(
                        aux.at[pl.ds(2 * ROWS, BLOCK)], (), layout=plgpu.Layout.WGMMA.reduce(0)
                    )
                if mask.segments:  # every step waits for its slot's ids: the barrier
                    # phases stay paired with the producer's loads (document tiles' unmasked
                    # steps read no ids)
                    plgpu.barrier_wait(aux_bars.at[stages + slot])
                    if masked:
                        k_seg = plgpu.load(
                            kseg_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0)
                        )
                plgpu.barrier_arrive(k_free.at[slot])
                factor = row_scale * inv_k  # > 0, or NaN for a bad query row
                s_seen = s  # the raw scores the row max runs over
                if masked:
                    q_pos = row0 + plgpu.broadcasted_iota(
                        jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA
                    )
                    k_pos = j * BLOCK + plgpu.broadcasted_iota(
                        jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA
                    )
                    valid = k_pos < mask.s
                    if mask.causal:
                        valid = valid & (q_pos >= k_pos)
                    if mask.segments:
                        valid = valid & (
                            lax.broadcast_in_dim(q_seg, s.shape, [0])
                            == lax.broadcast_in_dim(k_seg, s.shape, [1])
                        )
                    s_seen = jnp.where(valid, s, -jnp.inf)
                # max_j S2_ij = f_i max_j S_ij bit for bit (f_i > 0 and rounding is
                # monotone), so S2 - m' + 8 is one multiply-add per score
                m_new = jnp.maximum(m, s_seen.max(axis=1) * factor)
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
                s2 = s * lax.broadcast_in_dim(factor, s.shape, [0])
                s2 = s2 - lax.broadcast_in_dim(m_safe - P_EXPONENT, s.shape, [0])
                if masked:  # the keys' poison (a CTA with a bad key runs every step masked)
                    s2 = s2 + lax.broadcast_in_dim(k_poison, s.shape, [1])
                    s2 = jnp.where(valid, s2, -jnp.inf)
                p = jnp.exp2(s2)
                alpha = jnp.exp2(m - m_safe)
                l = l * alpha + p.sum(axis=1)
                # acc holds O's numerator in units of u (the last V decode factor): rescale
                # by alpha u / inv_v_j (powers of two apart from alpha), then add P^ V8_j.
                acc = acc * lax.broadcast_in_dim(alpha * (u / inv_v), acc.shape, [0])
                p8 = to_operand(p.astype(jnp.float8_e4m3fn))
                acc, l, m_new, p8 = lax.optimization_barrier((acc, l, m_new, p8))
                plgpu.barrier_arrive(schedule)  # softmax done
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(schedule)  # tensor cores free

                def wait_next_k():  # while the P V wgmma runs: the next tile's K
                    nxt = j + 1

                    @pl.when(nxt < steps)
                    def _():
                        plgpu.barrier_wait(k_bars.at[lax.rem(nxt - lo, stages)])

                def pv(acc_ref):  # P^ V8 with V^T K-major (tokens permuted like P^'s columns)
                    plgpu.wgmma(acc_ref, p8, vt_smem.at[slot].T)
                    wait_next_k()

                if interpret:  # the GPU interpreter takes A from shared memory, has no run_state
                    p_smem2.at[wg][...] = p8
                    plgpu.commit_smem()

                    def pv_interpret(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem2.at[wg], vt_smem.at[slot].T)
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_interpret, plgpu.ACC((ROWS, dv), jnp.float32))
                    wait_next_k()
                else:
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l, inv_v

            carry = (acc, m, l, jnp.ones_like(l))
            if documents:  # masked, unmasked (inside the document), masked
                bounds = clean_document_bounds(clean, (lo, tiles[0], tiles[1], steps))
                acc, m, l, u = document_loops(step, bounds, carry)
            else:
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
                acc, m, l, u = lax.fori_loop(
                    full, steps, functools.partial(step, masked=True), carry
                )

            def drain(j, _):  # tiles this warpgroup skips (causal): release them
                slot = lax.rem(j - lo, stages)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            lax.fori_loop(steps, hi, drain, None)
            pl.when(wg == 0)(schedule_barrier)

            empty = l == 0.0
            inv_l = u / jnp.where(empty, 1.0, l)
            o = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(out_dtype)
            log_l = jnp.log(jnp.where(empty, 1.0, l)) * (1.0 / LN2)
            lse_smem[...] = jnp.where(empty, jnp.inf, (m + log_l - P_EXPONENT) * LN2)
            for n, c0 in enumerate(range(0, dv, out_cols)):  # O [B, Tp, Hq, Dv], by columns
                if n:  # the previous columns' copy has read o_smem
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o_smem[...] = o if out_cols == dv else o[:, c0 : c0 + out_cols]
                plgpu.commit_smem()
                cols = pl.ds(c0, out_cols)
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[batch, rows, head, cols])
                if n == 0:
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == WARPGROUPS)
        def _producer():
            producer_registers()

            # this CTA's key tiles (with document tiles: its row's lo and hi)
            row = producer_row(tiles_ref, batch, q_tile, tiles_smem2, q_bars.at[5 * WARPGROUPS])
            lo, hi = cta_range(row, cta_steps)

            def load_k(j, slot):  # K, and the factors and segments read with S
                keys = pl.ds(j * BLOCK, BLOCK)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[batch, kv_head, keys], k_smem.at[slot], k_bars.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    kvinv_ref.at[batch, kv_head, j], kvinv_smem.at[slot], aux_bars.at[slot]
                )
                if mask.segments:
                    plgpu.copy_gmem_to_smem(
                        kvseg_ref.at[batch, keys], kseg_smem.at[slot], aux_bars.at[stages + slot]
                    )

            def load_v(j, slot):
                plgpu.copy_gmem_to_smem(
                    vt_ref.at[batch, kv_head, :, pl.ds(j * BLOCK, BLOCK)],
                    vt_smem.at[slot],
                    v_bars.at[slot],
                )

            n_steps = hi - lo  # step n loads key tile lo + n into slot n % stages
            for i in range(stages):

                @pl.when(i < n_steps)
                def _():
                    load_k(lo + i, i)
                    load_v(lo + i, i)

            @pl.loop(0, jnp.maximum(n_steps - stages, 0))
            def _(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(k_free.at[slot])
                load_k(lo + n + stages, slot)
                plgpu.barrier_wait(v_free.at[slot])
                load_v(lo + n + stages, slot)

            # the last releases too (nothing left to load): Pallas' GPU interpreter checks
            # at exit that every completed phase was observed, as the backward's _stream
            @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
            def _(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    def dm_fp8_attention_forward_mosaic(*refs):  # the kernel's name in profiles
        kseg = plgpu.SMEM((stages, BLOCK), jnp.int32) if mask.segments else None
        qseg = plgpu.SMEM((WARPGROUPS, ROWS), jnp.int32) if mask.segments else None
        smem = (
            plgpu.SMEM((WARPGROUPS, ROWS, dqk), jnp.float8_e4m3fn, transforms=fp8_transforms(dqk)),
            plgpu.SMEM(
                (WARPGROUPS, ROWS, out_cols), out_dtype, transforms=out_transforms(out_dtype)
            ),
            plgpu.SMEM((WARPGROUPS, ROWS), jnp.float32),
            plgpu.SMEM((WARPGROUPS, ROWS), jnp.float32),
            qseg,
            plgpu.SMEM((stages, BLOCK, dqk), jnp.float8_e4m3fn, transforms=fp8_transforms(dqk)),
            plgpu.SMEM((stages, dv, BLOCK), jnp.float8_e4m3fn, transforms=fp8_transforms(BLOCK)),
            plgpu.SMEM((stages, 2 * ROWS + BLOCK), jnp.float32),
            kseg,
            # P^ in shared memory: interpret mode only (its wgmma takes A from a ref)
            plgpu.SMEM((WARPGROUPS, ROWS, BLOCK), jnp.float8_e4m3fn) if interpret else None,
            # document tiles: each consumer's row, and the producer's copy of the first
            plgpu.SMEM((WARPGROUPS + 1, doc_tiles.shape[-1]), jnp.int32) if documents else None,
            plgpu.SMEM((WARPGROUPS, FLAG_WORDS), jnp.int32),  # the keys' poison flag
        )
        barriers = (
            # Q, its decode factors, its segments, its document tiles, the poison flag (+ the
            # producer's row)
            plgpu.Barrier(num_barriers=5 * WARPGROUPS + 1),
            plgpu.Barrier(num_barriers=stages),  # K
            plgpu.Barrier(num_barriers=stages),  # V^T
            # K's and V's decode factors with the keys' poison [stages], then the key segment
            # ids [stages]: one copy per barrier (Pallas' GPU interpreter counts one arrival
            # per barrier and copy)
            plgpu.Barrier(num_barriers=2 * stages),
            plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=stages),  # K slot free
            plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=stages),  # V slot free
            plgpu.Barrier(num_arrivals=WARPGROUPS),  # tensor-core schedule
        )
        pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, barriers, collective_axes="wg")

    args = [q8, q_inv, k8, vt8, kv_aux, kv_flags]
    if mask.segments:
        args += [q_seg, kv_seg]
    if documents:
        args.append(doc_tiles)
    out_type = [
        jax.ShapeDtypeStruct((b, tp, hq, dv), out_dtype),
        jax.ShapeDtypeStruct((b, hq, tp), jnp.float32),
    ]
    grid, grid_names = (hq, tp // block_q, b), ("heads", "q_seq", "batch")
    o, lse = warp_specialized_call(
        dm_fp8_attention_forward_mosaic, out_type, grid, grid_names, interpret
    )(*args)
    return o, lse
