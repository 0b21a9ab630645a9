"""Backward kernel: the gradients of Q, K, V, the log decays and b, one program per chunk.

The chunk is recomputed (Dec, gam, A, T = (I + A)^-1), then, from the cotangents dU_p, dW_p,
d(qg), dP and dK_end of the forward's outputs:

    P = Q K^T * Dec:    dQ = (dP * Dec) K + gam * d(qg)      dK  = (dP * Dec)^T Q
                        dDec  = dP * Q K^T                   dgam = rowsum(d(qg) * Q)
    K_end = Dec_C * K:  dK += Dec_C * dK_end                 dDec_C = rowsum(dK_end * K)
    U_p = T (b V), W_p = T (b gam K)   (delta rule):
        dT = dU_p (b V)^T + dW_p (b gam K)^T                 dA = -(T^T dT T^T), j < r
        d(bV) = T^T dU_p     d(b gam K) = T^T dW_p           dV = b d(bV)
        A = diag(b) (K K^T * Dec):  F = diag(b) dA * Dec     dK += F K + F^T K + b gam d(bgK)
        db = rowsum(V * d(bV)) + gam rowsum(K * d(bgK)) + rowsum(dA * K K^T * Dec)
        dgam += b rowsum(K * d(bgK))                         dDec += diag(b) dA * K K^T
    (plain rule: U_p = b V, so dV = b dU_p, db = rowsum(V * dU_p))
    Dec_rj = exp(G_r - G_j):  E = dDec * Dec,  dG = rowsum(E) - colsum(E) + dgam * gam
        (+ the same for Dec_C's row), and dg = the reverse cumulative sum of dG.

Every term is linear in its E or dgam, so two launches share the work: the pairs kernel
(P, qg, K_end) and the solve kernel (U_p, W_p), which adds its dK and dG to the first's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.chunk_local import common
from pallas_kernels.chunk_local.common import F32
from pallas_kernels.chunk_local.config import ChunkLocalConfig, check_kernel_shapes


def _pairs_kernel(
    q_ref,
    k_ref,
    g_ref,
    seg_ref,
    carried_ref,
    dqg_ref,
    dp_ref,
    dk_end_ref,
    dq_ref,
    dk_ref,
    dG_ref,
    *,
    precision,
):
    """The gradients through P, qg and K_end: dQ (whole), dK and dG (their parts)."""
    dot = functools.partial(common.dot, precision=precision)
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    dec, gam, dec_last = common.chunk_decays(g_ref[...].astype(F32), seg_ref[...], carried_ref[...])
    dP, dqg, dk_end = dp_ref[...], dqg_ref[...], dk_end_ref[...]
    dP_dec = dP * dec
    dq_ref[...] = dot(dP_dec, k) + gam[:, None] * dqg  # P = Q K^T * Dec, qg = gam * Q
    dk_ref[...] = dot(dP_dec, q, trans_a=True) + dec_last[:, None] * dk_end  # K_end = Dec_C K
    E = dP * dot(q, k, trans_b=True) * dec  # dDec * Dec
    dgam = jnp.sum(dqg * q, axis=1)
    dG_ref[...] = _decay_gradient(E, jnp.sum(dk_end * k, axis=1) * dec_last, dgam * gam)


def _solve_kernel(
    k_ref, v_ref, g_ref, b_ref, seg_ref, carried_ref, du_p_ref, *refs, delta_rule, precision
):
    """The gradients through U_p and W_p: dV and db (whole), dK and dG added to the pairs
    kernel's parts (read from dk_in and dG_in), and dg, the reverse cumulative sum of dG."""
    dot = functools.partial(common.dot, precision=precision)
    refs = list(refs)
    dw_p_ref, t_ref = (refs.pop(0), refs.pop(0)) if delta_rule else (None, None)
    dk_in_ref, dG_in_ref, dk_ref, dv_ref, dg_ref, db_ref = refs
    b = b_ref[...].astype(F32)
    v, du_p = v_ref[...].astype(F32), du_p_ref[...]
    dG = dG_in_ref[...]
    if delta_rule:  # in an order that lets each [C, X] tile's shared-memory copies die early
        dec, gam, _ = common.chunk_decays(g_ref[...].astype(F32), seg_ref[...], carried_ref[...])
        T = t_ref[...]  # (I + A)^-1, the forward's
        # U_p = T (b V)
        dT = dot(du_p, b[:, None] * v, trans_b=True)
        d_bv = dot(T, du_p, trans_a=True)  # T^T dU_p
        dv_ref[...] = b[:, None] * d_bv
        db = jnp.sum(v * d_bv, axis=1)
        # W_p = T (b gam K)
        k = k_ref[...].astype(F32)
        dw_p = dw_p_ref[...]
        dT = dT + dot(dw_p, (b * gam)[:, None] * k, trans_b=True)
        d_bgk = dot(T, dw_p, trans_a=True)  # T^T dW_p
        k_d_bgk = jnp.sum(k * d_bgk, axis=1)
        dk = (b * gam)[:, None] * d_bgk
        # A = diag(b) (K K^T * Dec), T = (I + A)^-1: dA = -(T^T dT T^T), j < r
        dA = -common.strictly_lower(dot(dot(T, dT, trans_a=True), T, trans_b=True))
        kk = dot(k, k, trans_b=True)
        dA_dec = dA * dec
        db_ref[...] = db + gam * k_d_bgk + jnp.sum(dA_dec * kk, axis=1)
        F = b[:, None] * dA_dec  # d(K K^T)
        dG = dG + _decay_gradient(F * kk, None, b * k_d_bgk * gam)  # dDec * Dec = F K K^T
        k = k_ref[...].astype(F32)  # loaded again (after the stores): a fresh operand copy
        dk_ref[...] = dk_in_ref[...] + dk + dot(F, k) + dot(F, k, trans_a=True)
    else:  # U_p = b V
        dv_ref[...] = b[:, None] * du_p
        db_ref[...] = jnp.sum(v * du_p, axis=1)
        dk_ref[...] = dk_in_ref[...]
    dg_ref[...] = common.reverse_cumsum(dG)  # G = cumsum(g)


def _decay_gradient(E_CC, E_last_C, dgam_gam_C):
    """dG from E = dDec * Dec (Dec_rj = exp(G_r - G_j): rowsum(E) - colsum(E)), from the
    same of Dec's last row (E_last, or None) and from gam = exp(G) * carried (dgam * gam)."""
    dG = jnp.sum(E_CC, axis=1) - jnp.sum(E_CC, axis=0) + dgam_gam_C
    if E_last_C is not None:
        c = E_CC.shape[0]
        is_last = jax.lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1
        dG = dG - E_last_C + jnp.where(is_last, jnp.sum(E_last_C), 0.0)
    return dG


def backward(
    q,
    k,
    v,
    g,
    b,
    seg,
    carried,
    T,
    cotangents,
    *,
    delta_rule: bool,
    config: ChunkLocalConfig,
    interpret=False,
):
    """(dq, dk, dv, dg, db), float32, in the layouts of q, k, v, g, b ([B, N, C, H, X] and
    [B, N, C, H]), from the forward's inputs and the cotangents (du_p, dw_p or None, dqg, dP,
    dk_end) of its outputs, [N, B, H, C, X], and the forward's stored T = (I + A)^-1 (None
    for the plain rule). Two launches, so that neither holds every
    tile at once: the pairs kernel (dQ, and dK and dG through P, qg, K_end), then the solve
    kernel (dV, db, the rest of dK and dG, and dg)."""
    B, N, C, H, K = q.shape
    V = v.shape[-1]
    check_kernel_shapes(C, K, V)
    du_p, dw_p, dqg, dP, dk_end = (None if x is None else x.astype(F32) for x in cotangents)
    tokens = lambda x: jax.ShapeDtypeStruct((B, N, C, H, x), F32)
    gates = jax.ShapeDtypeStruct((B, N, C, H), F32)
    seg, carried = seg.astype(jnp.int32), carried.astype(F32)
    positions = [common.positions_spec(C)] * 2
    dq, dk_pairs, dG_pairs = pl.pallas_call(
        functools.partial(_pairs_kernel, precision=config.precision),
        grid=(B, N, H),
        in_specs=[common.tokens_spec(C, K)] * 2
        + [common.gates_spec(C)]
        + positions
        + [common.chunk_spec(C, K), common.chunk_spec(C, C), common.chunk_spec(C, K)],
        out_specs=[common.tokens_spec(C, K)] * 2 + [common.gates_spec(C)],
        out_shape=[tokens(K), tokens(K), gates],
        compiler_params=config.compiler_params(backward=True),
        interpret=interpret,
        name="dm_chunk_local_backward_pairs",
    )(q, k, g, seg, carried, dqg, dP, dk_end)
    dk, dv, dg, db = pl.pallas_call(
        functools.partial(_solve_kernel, delta_rule=delta_rule, precision=config.precision),
        grid=(B, N, H),
        in_specs=[common.tokens_spec(C, K), common.tokens_spec(C, V)]
        + [common.gates_spec(C)] * 2
        + positions
        + [common.chunk_spec(C, V)]
        + [common.chunk_spec(C, K), common.chunk_spec(C, C)] * delta_rule
        + [common.tokens_spec(C, K), common.gates_spec(C)],
        out_specs=[common.tokens_spec(C, K), common.tokens_spec(C, V)] + [common.gates_spec(C)] * 2,
        out_shape=[tokens(K), tokens(V), gates, gates],
        input_output_aliases={7 + 2 * delta_rule: 0},  # dK accumulates in place
        compiler_params=config.compiler_params(backward=True),
        interpret=interpret,
        name="dm_chunk_local_backward_solve",
    )(k, v, g, b, seg, carried, du_p, *([dw_p, T] if delta_rule else []), dk_pairs, dG_pairs)
    return dq, dk, dv, dg, db
