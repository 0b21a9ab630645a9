"""Forward kernel: the state pass's operands of every chunk, one program per chunk.

Per chunk (package docstring for the symbols):

    A   = diag(b) (K K^T * Dec), j < r                       [C, C]   (delta rule)
    T   = (I + A)^-1                                          [C, C]   (by doubling)
    U_p = T (b * V)     W_p = T (b gam * K)                   [C, V], [C, K]   (plain: U_p = b V)
    P   = Q K^T * Dec   qg  = gam * Q     K_end = dec_last * K
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.chunk_local import common
from pallas_kernels.chunk_local.common import F32
from pallas_kernels.chunk_local.config import ChunkLocalConfig, check_kernel_shapes


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    b_ref,
    seg_ref,
    carried_ref,
    *outs,
    delta_rule,
    store_inverse,
    precision,
):
    dot = functools.partial(common.dot, precision=precision)
    u_p_ref, *rest = outs
    w_p_ref = rest.pop(0) if delta_rule else None
    t_ref = rest.pop() if store_inverse else None
    qg_ref, p_ref, k_end_ref = rest
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    b = b_ref[...].astype(F32)
    dec, gam, dec_last = common.chunk_decays(g_ref[...].astype(F32), seg_ref[...], carried_ref[...])
    rhs_u = b[:, None] * v_ref[...].astype(F32)  # b V
    if delta_rule:
        A = common.strictly_lower(b[:, None] * dot(k, k, trans_b=True) * dec)
        T = common.unit_lower_inverse(A, dot)
        if t_ref is not None:
            t_ref[...] = T
        u_p_ref[...] = dot(T, rhs_u)  # U_p = (I + A)^-1 b V
        w_p_ref[...] = dot(T, (b * gam)[:, None] * k)  # W_p = (I + A)^-1 b gam K
    else:
        u_p_ref[...] = rhs_u
    p_ref[...] = dot(q, k, trans_b=True) * dec  # P = Q K^T * Dec
    qg_ref[...] = gam[:, None] * q
    k_end_ref[...] = dec_last[:, None] * k  # K_end = Dec_C * K


def forward(
    q,
    k,
    v,
    g,
    b,
    seg,
    carried,
    *,
    delta_rule: bool,
    config: ChunkLocalConfig,
    store_inverse: bool = False,
    interpret=False,
):
    """((u_p, w_p or None, qg, P, k_end), T or None), float32 in the chunk layout
    [N, B, H, C, X]; T = (I + A)^-1 [N, B, H, C, C] with ``store_inverse`` (delta rule: the
    residual the backward reads instead of inverting again). From
    q, k [B, N, C, H, K], v [B, N, C, H, V], g and b [B, N, C, H], seg (int32) and carried
    (float32, 1 where the position is still in the document its chunk started in) [B, N, C].
    C, K, V: powers of two >= 16 (the caller pads K and V)."""
    B, N, C, H, K = q.shape
    V = v.shape[-1]
    check_kernel_shapes(C, K, V)
    chunks = lambda x: jax.ShapeDtypeStruct((N, B, H, C, x), F32)
    out_shape = [chunks(V)] + [chunks(K)] * delta_rule + [chunks(K), chunks(C), chunks(K)]
    out_specs = [common.chunk_spec(C, V)] + [common.chunk_spec(C, K)] * delta_rule
    out_specs += [common.chunk_spec(C, K), common.chunk_spec(C, C), common.chunk_spec(C, K)]
    store_inverse = store_inverse and delta_rule
    out_shape += [chunks(C)] * store_inverse
    out_specs += [common.chunk_spec(C, C)] * store_inverse
    outs = pl.pallas_call(
        functools.partial(
            _forward_kernel,
            delta_rule=delta_rule,
            store_inverse=store_inverse,
            precision=config.precision,
        ),
        grid=(B, N, H),
        in_specs=[common.tokens_spec(C, K)] * 2
        + [common.tokens_spec(C, V), common.gates_spec(C), common.gates_spec(C)]
        + [common.positions_spec(C)] * 2,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=config.compiler_params(backward=False),
        interpret=interpret,
        name="dm_chunk_local_forward",
    )(q, k, v, g, b, seg.astype(jnp.int32), carried.astype(F32))
    outs = list(outs)
    T = outs.pop() if store_inverse else None
    if not delta_rule:
        outs.insert(1, None)
    return tuple(outs), T
