"""The chunked recurrence's "pallas" state pass: the Pallas kernels of
`pallas_kernels.linear_recurrence` behind a `jax.custom_vjp`.

`pallas_state_pass` takes the chunked form's per-chunk operands (layout [N, B, H, C, X]) and
returns every chunk's output and the final state, as the sequential pass's `lax.scan` does,
in one kernel launch forward and one backward. With `StatePassConfig.token_major_outputs`
(the default) the outputs come token-major, [B, N * C, H, V], and their cotangents are read
so: the model's layout, with no transpose of either in XLA. The forward under differentiation writes each
chunk's start state [N, B, H, K, V] float32 (the residual the backward reads; the
sequential scan's autodiff keeps the same states); the plain forward does not.

The kernels need C, K and V to be powers of two >= 16: other sizes are zero-padded here
(exact: zero rows and columns of the operands keep the padded part of S at zero and add
nothing to the rest), outside the custom VJP so autodiff slices the gradients back.
Compiled on a GPU, Pallas interpret mode elsewhere.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.linear_recurrence.backward import backward
from pallas_kernels.linear_recurrence.common import ChunkSteps
from pallas_kernels.linear_recurrence.config import StatePassConfig, kernel_size
from pallas_kernels.linear_recurrence.forward import forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _state_pass(config, interpret, S0, steps):
    o, S, _ = forward(S0, steps, config=config, store_states=False, interpret=interpret)
    return o, S


def _state_pass_fwd(config, interpret, S0, steps):
    o, S, starts = forward(S0, steps, config=config, store_states=True, interpret=interpret)
    return (o, S), (starts, steps)


def _state_pass_bwd(config, interpret, residuals, cotangents):
    starts, steps = residuals
    do, dS_end = cotangents
    return backward(dS_end, do, starts, steps, config=config, interpret=interpret)


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)

# One traced jaxpr per shapes and settings, so an unscanned model's layers share the kernels'
# lowering and compilation instead of repeating them per layer (as dm_jax.attention_op).
_shared_state_pass = jax.jit(_state_pass, static_argnums=(0, 1))


def _pad_to(x, sizes):
    """Zero-pad the trailing len(sizes) axes of x up to `sizes` (None stays None)."""
    if x is None:
        return None
    lead = [(0, 0)] * (x.ndim - len(sizes))
    widths = lead + [(0, n - m) for n, m in zip(sizes, x.shape[-len(sizes) :])]
    return x if all(w == (0, 0) for w in widths) else jnp.pad(x, widths)


def pallas_state_pass(
    S0_BHKV,
    u_p,
    w_p,
    qg,
    P,
    k_end,
    gam_end,
    *,
    config: Optional[StatePassConfig] = None,
    interpret: Optional[bool] = None,
):
    """`dm_jax.nn.recurrence.sequential_state_pass` (same operands and results: o and the
    final S_BHKV, float32) in one Pallas kernel per direction. o is [N, B, H, C, V] as the
    scan's, or token-major [B, N * C, H, V] with ``config.token_major_outputs`` (the
    default; chunk n's row r is token n * C + r).

    gam_end [N, B, H, G, 1]: G = 1 (one decay per head) or K (per key channel).
    ``config``: launch settings (None: the defaults); ``interpret``: None runs the compiled
    kernels on a GPU and Pallas interpret mode on other backends.
    """
    config = StatePassConfig() if config is None else config
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    N, B, H, C, V = u_p.shape
    K = qg.shape[-1]
    Cp, Kp, Vp = kernel_size(C), kernel_size(K), kernel_size(V)
    steps = ChunkSteps(
        u_p=_pad_to(u_p, (Cp, Vp)),
        w_p=_pad_to(w_p, (Cp, Kp)),
        qg=_pad_to(qg, (Cp, Kp)),
        P=_pad_to(P, (Cp, Cp)),
        k_end=_pad_to(k_end, (Cp, Kp)),
        gam_end=_pad_to(jnp.broadcast_to(gam_end[..., 0], (N, B, H, K)), (Kp,)),
    )
    o, S = _shared_state_pass(config, interpret, _pad_to(S0_BHKV, (Kp, Vp)), steps)
    if config.token_major_outputs:  # [B, N, Cp, H, Vp]
        return o[:, :, :C, :, :V].reshape(B, N * C, H, V), S[..., :K, :V]
    return o[..., :C, :V], S[..., :K, :V]
