"""Forward kernel: O and the log-sum-exp, online softmax in FP32, both dots in FP8.

Per (batch, query head, query tile) and key tile j (m, l, acc: FP32 row state):
    S_j = (Q^ K^_j^T) * (scale inv_q inv_k)               (common.scores)
    m'  = max(m, rowmax S_j);  p = exp(S_j - m');  alpha = exp(m - m')
    l   = alpha l + rowsum p
    acc = alpha acc + ((p * 256)^ V^_j) * (inv_v / 256)    (P cast with the fixed scale)
    O = acc / l (0 for rows with no visible key),  lse = m + log l (+inf there)
P^ V^ reads V from its K-major copy V^T [Dv, S] (tokens contiguous).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.triton import common
from pallas_kernels.fp8_attention.triton.common import F32, MaskSpec


def _forward_kernel(
    q_ref,
    inv_q_ref,
    k_ref,
    inv_k_ref,
    vt_ref,
    inv_v_ref,
    *rest,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    n_k: int,
):
    if mask.segments:
        q_seg_ref, kv_seg_ref, o_ref, lse_ref = rest
    else:
        (o_ref, lse_ref), q_seg_ref, kv_seg_ref = rest, None, None
    i = pl.program_id(0)
    q8 = q_ref[...]  # [bq, Dqk]
    inv_q = inv_q_ref[...]  # [bq]
    q_pos = common.positions(i, block_q)
    q_seg = q_seg_ref[...] if mask.segments else None
    p_scale = numerics.p_scale(precision)

    def body(j, carry, masked):
        m, l, acc = carry
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        valid = None
        if masked:
            k_seg = kv_seg_ref[keys] if mask.segments else None
            valid = common.valid_mask(mask, q_pos, common.positions(j, block_k), q_seg, k_seg)
        s = common.scores(q8, k_ref[keys, :], inv_q, inv_k_ref[keys], sm_scale, valid)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=1)
        p8 = numerics.cast_probabilities(p, precision)
        # P^ V^ with V^T [Dv, bk] (K-major): contraction over the key tile.
        pv = common.dot_nt(p8, vt_ref[:, keys])
        pv = pv * (common.tile_scalar(inv_v_ref[keys]) / p_scale)
        return m_new, l, alpha[:, None] * acc + pv

    dv = o_ref.shape[-1]
    init = (
        jnp.full((block_q,), -jnp.inf, F32),
        jnp.zeros((block_q,), F32),
        jnp.zeros((block_q, dv), F32),
    )
    m, l, acc = common.key_loop(body, init, i, block_q, block_k, n_k, mask)
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def forward(
    q,
    k,
    v,
    q_seg=None,
    kv_seg=None,
    *,
    mask: MaskSpec,
    sm_scale: float,
    precision: str,
    block_q: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    out_dtype,
    interpret: bool,
    fp8_accumulation: str = "precise",
):
    """Run the forward kernel on quantized, padded operands.

    Args:
      q: QuantizedTensor, values [B, Hq, Tp, Dqk]; k: values [B, Hkv, Sp, Dqk];
      v: QuantizedTensor with ``values_t`` [B, Hkv, Dv, Sp];
      q_seg [B, Tp] / kv_seg [B, Sp]: int32 segment ids (only when ``mask.segments``).
    Returns:
      o [B, Hq, Tp, Dv] in ``out_dtype``, lse [B, Hq, Tp] f32.
    """
    b, hq, tp, dqk, hkv, sp, dv, group = common.dims(q, k, v)
    grid = (tp // block_q, b, hq)
    kernel = functools.partial(
        _forward_kernel,
        mask=mask,
        sm_scale=sm_scale,
        precision=precision,
        block_q=block_q,
        block_k=block_k,
        n_k=sp // block_k,
    )
    specs = common.QueryGridSpecs(block_q, group)
    in_specs = [
        specs.q_tile(dqk),
        specs.q_rows(),
        specs.kv_whole(sp, dqk),
        specs.kv_rows(sp),
        specs.kv_whole(dv, sp),
        specs.kv_rows(sp),
    ]
    args = [q.values, q.inv_scale, k.values, k.inv_scale, v.values_t, v.inv_scale]
    if mask.segments:
        in_specs += specs.segments(sp)
        args += [q_seg, kv_seg]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[specs.q_tile(dv), specs.q_rows()],
        out_shape=[
            jax.ShapeDtypeStruct((b, hq, tp, dv), out_dtype),
            jax.ShapeDtypeStruct((b, hq, tp), F32),
        ],
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=common.kernel_name("dm_fp8_attention_forward", fp8_accumulation),
    )(*args)
