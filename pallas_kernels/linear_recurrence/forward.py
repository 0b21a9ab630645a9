"""Forward kernel: every chunk's output and the final state in one launch.

One program per (batch, head, V block); the state's V block S [K, vb] stays in registers
while the program walks the N chunks in order (V blocks are independent: every product
below keeps V's columns apart). Per chunk c:

    U   = U_p - W_p S                       [C, vb]   (plain rule: U = U_p)
    o_c = (exp(G) * Q) S + P U              [C, vb]
    S  <- exp(G_C) * S + K_end^T U          [K, vb]   (exp(G_C) scales S's rows)

With ``store_states`` the kernel also writes each chunk's start state S_c, which the
backward reads instead of recomputing the recurrence.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_recurrence import common
from pallas_kernels.linear_recurrence.common import F32, ChunkSteps
from pallas_kernels.linear_recurrence.config import StatePassConfig, check_kernel_shapes


def _forward_kernel(s0_ref, u_p_ref, *refs, plain: bool, store_states: bool, precision):
    refs = list(refs)
    w_p_ref = None if plain else refs.pop(0)
    qg_ref, p_ref, k_end_ref, gam_end_ref, o_ref, s_end_ref = refs[:6]
    starts_ref = refs[6] if store_states else None
    dot = functools.partial(common.dot, precision=precision)

    def step(c, S_KV):
        if store_states:
            starts_ref[c] = S_KV
        u_CV = u_p_ref[c]
        if w_p_ref is not None:
            u_CV = u_CV - dot(w_p_ref[c], S_KV)  # U = U_p - W_p S
        o_ref[c] = dot(qg_ref[c], S_KV) + dot(p_ref[c], u_CV)  # o = (exp(G) Q) S + P U
        # S' = exp(G_C) * S + K_end^T U
        return gam_end_ref[c][:, None] * S_KV + dot(k_end_ref[c], u_CV, trans_a=True)

    s_end_ref[...] = jax.lax.fori_loop(0, u_p_ref.shape[0], step, s0_ref[...])


def forward(
    S0_BHKV,
    steps: ChunkSteps,
    *,
    config: StatePassConfig,
    store_states: bool,
    interpret: bool = False,
):
    """(o, S_end_BHKV, starts_NBHKV or None), all float32, from the start state S0
    [B, H, K, V] through the chunks of ``steps``. o is [B, N, C, H, V] with
    ``config.token_major_outputs``, else [N, B, H, C, V].

    C, K, V: powers of two >= 16 (the caller pads); V is split into blocks of
    ``config.block_v``. ``starts`` (with ``store_states``): every chunk's start state.
    """
    N, B, H, C, K, V = steps.dims
    check_kernel_shapes(C, K, V, config, compiled=not interpret)
    vb = min(config.block_v, V)
    plain = steps.w_p is None
    per_v = common.chunks_spec(N, C, vb, v_blocked=True)
    token_major = config.token_major_outputs
    out_specs = [common.outputs_spec(N, C, vb, token_major), common.state_spec(K, vb)]
    out_shape = [
        jax.ShapeDtypeStruct(common.outputs_shape(N, B, H, C, V, token_major), F32),
        jax.ShapeDtypeStruct((B, H, K, V), F32),
    ]
    if store_states:
        out_specs.append(common.states_spec(N, K, vb))
        out_shape.append(jax.ShapeDtypeStruct((N, B, H, K, V), F32))
    outs = pl.pallas_call(
        functools.partial(
            _forward_kernel, plain=plain, store_states=store_states, precision=config.precision
        ),
        grid=(B, H, V // vb),
        in_specs=[common.state_spec(K, vb), per_v] + common.shared_specs(N, C, K, plain),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=config.compiler_params(backward=False),
        interpret=interpret,
        name="dm_linear_recurrence_forward",
    )(S0_BHKV.astype(F32), steps.u_p.astype(F32), *steps.shared_operands())
    return outs[0], outs[1], (outs[2] if store_states else None)
