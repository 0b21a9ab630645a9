"""Backward: the gradients of every chunk's inputs and of the start state.

Only dS has to cross chunks, and its step needs neither S nor U:

    dU       = P^T dO + K_end dS'                   [C, vb]   (dS': gradient of S after c)
    dS       = qg^T dO + exp(G_C) * dS' - W_p^T dU  [K, vb]   (carried to chunk c - 1)

so one kernel launch walks the chunks in reverse (one program per (batch, head, V block),
dS in registers, the final state's cotangent to begin with) and writes dU = dU_p and every
dS' (and, when dO comes token-major, dO's copy in the chunk layout the matmuls below read). The gradients that contract over V need S and U but no carry, so they run after it as
batched matmuls over all chunks (full V: nothing is summed over V blocks), from the start
states S the forward stored and U = U_p - W_p S recomputed:

    dW_p     = -dU S^T        d(qg) = dO S^T        (qg = exp(G) * Q)          [C, K]
    dP       = dO U^T         dK_end = U dS'^T      dexp(G_C) = rowsum(S * dS')
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_recurrence import common
from pallas_kernels.linear_recurrence.common import F32, ChunkSteps
from pallas_kernels.linear_recurrence.config import StatePassConfig, check_kernel_shapes


def _backward_kernel(ds_end_ref, do_ref, *refs, plain: bool, copy_do: bool, precision):
    refs = list(refs)
    w_p_ref = None if plain else refs.pop(0)
    qg_ref, p_ref, k_end_ref, gam_end_ref, du_ref, ds_after_ref, ds0_ref = refs[:7]
    do_chunks_ref = refs[7] if copy_do else None
    dot = functools.partial(common.dot, precision=precision)
    n_chunks = do_ref.shape[0]

    def step(i, dS_KV):  # dS_KV: gradient of the state after chunk c
        c = n_chunks - 1 - i
        ds_after_ref[c] = dS_KV
        do_CV = do_ref[c]
        if do_chunks_ref is not None:
            do_chunks_ref[c] = do_CV
        du_CV = dot(p_ref[c], do_CV, trans_a=True) + dot(k_end_ref[c], dS_KV)  # P^T dO + K_end dS'
        du_ref[c] = du_CV
        dS_prev = dot(qg_ref[c], do_CV, trans_a=True) + gam_end_ref[c][:, None] * dS_KV
        if w_p_ref is not None:
            dS_prev = dS_prev - dot(w_p_ref[c], du_CV, trans_a=True)  # - W_p^T dU
        return dS_prev

    ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, step, ds_end_ref[...])


def carry_gradients(
    dS_end_BHKV, do, steps: ChunkSteps, *, config: StatePassConfig, interpret: bool = False
):
    """The reverse pass over chunks in one launch: (dS0_BHKV, dU_NBHCV, dS_after_NBHKV,
    dO_NBHCV), float32; dS_after[c] is the gradient of the state after chunk c (U_p is not
    read). dO comes in the forward's output layout (``config.token_major_outputs``); the
    last result is dO in the chunk layout (the kernel's copy, or dO itself)."""
    N, B, H, C, K, V = steps.dims
    check_kernel_shapes(C, K, V, config, compiled=not interpret)
    vb = min(config.block_v, V)
    per_v = common.chunks_spec(N, C, vb, v_blocked=True)
    token_major = config.token_major_outputs
    chunk_shape = jax.ShapeDtypeStruct((N, B, H, C, V), F32)
    outs = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            plain=steps.w_p is None,
            copy_do=token_major,
            precision=config.precision,
        ),
        grid=(B, H, V // vb),
        in_specs=[common.state_spec(K, vb), common.outputs_spec(N, C, vb, token_major)]
        + common.shared_specs(N, C, K, steps.w_p is None),
        out_specs=[per_v, common.states_spec(N, K, vb), common.state_spec(K, vb)]
        + [per_v] * token_major,
        out_shape=[
            chunk_shape,
            jax.ShapeDtypeStruct((N, B, H, K, V), F32),
            jax.ShapeDtypeStruct((B, H, K, V), F32),
        ]
        + [chunk_shape] * token_major,
        compiler_params=config.compiler_params(backward=True),
        interpret=interpret,
        name="dm_linear_recurrence_backward",
    )(dS_end_BHKV.astype(F32), do.astype(F32), *steps.shared_operands())
    du, dS_after, dS0 = outs[:3]
    return dS0, du, dS_after, (outs[3] if token_major else do.astype(F32))


def backward(
    dS_end_BHKV,
    do,
    starts_NBHKV,
    steps: ChunkSteps,
    *,
    config: StatePassConfig,
    interpret: bool = False,
):
    """Gradients of :func:`.forward.forward`'s inputs from the cotangents of its outputs
    (dS_end [B, H, K, V] of the final state, dO of the outputs in their layout: [B, N, C,
    H, V] with ``config.token_major_outputs``, else [N, B, H, C, V]), given its stored
    start states and the same ``steps``.

    Returns (dS0_BHKV, d steps: a ChunkSteps of float32 gradients, w_p None for the plain
    rule). The batched matmuls after the kernel use ``config``'s dot precision too.
    """
    dS0, du, dS_after, do_NBHCV = carry_gradients(
        dS_end_BHKV, do, steps, config=config, interpret=interpret
    )
    mm = functools.partial(jnp.einsum, precision=config.precision, preferred_element_type=F32)
    S, w_p, do = starts_NBHKV, steps.w_p, do_NBHCV
    u = steps.u_p if w_p is None else steps.u_p - mm("...ck,...kv->...cv", w_p, S)
    return dS0, ChunkSteps(
        u_p=du,
        w_p=None if w_p is None else -mm("...cv,...kv->...ck", du, S),
        qg=mm("...cv,...kv->...ck", do, S),
        P=mm("...cv,...jv->...cj", do, u),
        k_end=mm("...cv,...kv->...ck", u, dS_after),
        gam_end=jnp.sum(S * dS_after, axis=-1),
    )
