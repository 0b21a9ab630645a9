"""The chunked recurrence's "pallas" chunk-local stage: the kernels of
`pallas_kernels.chunk_local` behind a `jax.custom_vjp`.

`pallas_chunk_local` takes the recurrence's inputs token-major ([B, T, H, X], T a multiple
of C) and returns the state pass's per-chunk operands (u_p, w_p, qg, P, k_end in the chunk
layout [N, B, H, C, X], and gam_end [N, B, H, 1, 1]): what `recurrent_chunked`'s XLA stages
chunk_prep, pair and solve compute, in one kernel launch forward and one backward, with the
[C, C] decays, A and (I + A)^-1 never leaving the chip. One decay per head only (G = 1).
The residuals are the inputs and, for the delta rule, T = (I + A)^-1 [N, B, H, C, C] (the
backward recomputes the rest of the chunk).

K and V are zero-padded to powers of two >= 16 (exact: zero columns add nothing to K K^T
or Q K^T, and the padded output columns are sliced off), outside the custom VJP so autodiff
slices the gradients back. Compiled on a GPU, Pallas interpret mode elsewhere.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_local.backward import backward
from pallas_kernels.chunk_local.config import ChunkLocalConfig, check_kernel_shapes
from pallas_kernels.chunk_local.forward import forward
from pallas_kernels.linear_recurrence.config import kernel_size


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunk_local(delta_rule, config, interpret, q, k, v, g, b, seg, carried):
    kw = dict(delta_rule=delta_rule, config=config, interpret=interpret)
    return forward(q, k, v, g, b, seg, carried, **kw)[0]


def _chunk_local_fwd(delta_rule, config, interpret, q, k, v, g, b, seg, carried):
    kw = dict(delta_rule=delta_rule, config=config, interpret=interpret)
    outs, T = forward(q, k, v, g, b, seg, carried, store_inverse=True, **kw)
    return outs, (q, k, v, g, b, seg, carried, T)


def _chunk_local_bwd(delta_rule, config, interpret, residuals, cotangents):
    q, k, v, g, b, seg, carried, _ = residuals
    grads = backward(
        *residuals, cotangents, delta_rule=delta_rule, config=config, interpret=interpret
    )
    dq, dk, dv, dg, db = (d.astype(x.dtype) for d, x in zip(grads, (q, k, v, g, b)))
    return dq, dk, dv, dg, db, None, None


_chunk_local.defvjp(_chunk_local_fwd, _chunk_local_bwd)

# one traced jaxpr per shapes and settings, shared by an unscanned model's layers
_shared_chunk_local = jax.jit(_chunk_local, static_argnums=(0, 1, 2))


def check_chunk_local(c: int, g: int) -> None:
    """ValueError unless the kernels take chunks of c steps and a decay of width g."""
    if g != 1:
        raise ValueError(f"chunk_local='pallas' needs one decay per head (G = 1), got G = {g}")
    check_kernel_shapes(c, 16, 16)


def pallas_chunk_local(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    log_decay_BTH,
    beta_BTH,
    seg_BT,
    carried_BT,
    *,
    chunk_size: int,
    delta_rule: bool,
    config: Optional[ChunkLocalConfig] = None,
    interpret: Optional[bool] = None,
):
    """(u_p, w_p or None, qg, P, k_end, gam_end) float32 of `recurrent_chunked` for T a
    multiple of chunk_size (zero-padded steps: k = v = b = g = 0). seg_BT: segment ids
    (int); carried_BT: 1.0 where a position is in the document its chunk started in (the
    carried start state reaches it), else 0.0."""
    config = ChunkLocalConfig() if config is None else config
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    if T % C:
        raise ValueError(f"T ({T}) must be a multiple of chunk_size ({C}): pad first")
    check_chunk_local(C, 1)
    N = T // C
    Kp, Vp = kernel_size(K), kernel_size(V)
    pad = lambda x, n: x if x.shape[-1] == n else jnp.pad(x, [(0, 0)] * 3 + [(0, n - x.shape[-1])])
    tokens = lambda x, n: pad(x, n).reshape(B, N, C, H, n)
    outs = _shared_chunk_local(
        delta_rule,
        config,
        interpret,
        tokens(q_BTHK, Kp),
        tokens(k_BTHK, Kp),
        tokens(v_BTHV, Vp),
        log_decay_BTH.reshape(B, N, C, H),
        beta_BTH.reshape(B, N, C, H),
        seg_BT.astype(jnp.int32).reshape(B, N, C),
        carried_BT.astype(jnp.float32).reshape(B, N, C),
    )
    u_p, w_p, qg, P, k_end = outs
    # gam_end = exp(G_C) * carried_C per chunk and head: tiny, left to XLA (and its autodiff)
    G_end = jnp.sum(log_decay_BTH.astype(jnp.float32).reshape(B, N, C, H), axis=2)
    gam_end = jnp.exp(G_end) * carried_BT.astype(jnp.float32).reshape(B, N, C)[:, :, -1:]
    gam_end = jnp.transpose(gam_end, (1, 0, 2))[..., None, None]  # [N, B, H, 1, 1]
    return (
        u_p[..., :V],
        None if w_p is None else w_p[..., :K],
        qg[..., :K],
        P,
        k_end[..., :K],
        gam_end,
    )
