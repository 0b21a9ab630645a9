"""Block specs and dots shared by the forward and backward kernels.

Layout: per-chunk operands [N, B, H, C, X] (the chunked form's layout), decays [N, B, H, K],
states [B, H, K, V] (and [N, B, H, K, V] for every chunk's start state). The outputs o and
their cotangents dO may instead be token-major, [B, N, C, H, V] (a reshape of the model's
[B, T, H, V], so neither direction transposes them in XLA). The grid is (B, H, V // block_v);
each program sees all N chunks of its (batch, head) and loops over them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32


class ChunkSteps(NamedTuple):
    """The per-chunk operands of the state pass (a pytree; gradients come back as one).

    u_p [N, B, H, C, V]; w_p [N, B, H, C, K], None for the plain rule; qg = exp(G) * Q
    [N, B, H, C, K]; P [N, B, H, C, C]; k_end [N, B, H, C, K]; gam_end = exp(G_C) per key
    channel [N, B, H, K] (a per-head decay broadcast over K).
    """

    u_p: jax.Array
    w_p: Optional[jax.Array]
    qg: jax.Array
    P: jax.Array
    k_end: jax.Array
    gam_end: jax.Array

    @property
    def dims(self) -> tuple:
        """(N, B, H, C, K, V)."""
        return self.u_p.shape[:4] + (self.qg.shape[-1], self.u_p.shape[-1])

    def shared_operands(self) -> list:
        """(W_p unless plain, qg, P, K_end, exp(G_C)) as float32, in kernel-argument order:
        the operands every program reads whole (see :func:`shared_specs`)."""
        return [x.astype(F32) for x in self[1:] if x is not None]


def dot(a, b, *, precision, trans_a: bool = False, trans_b: bool = False):
    """op(a) @ op(b) with f32 accumulation; op transposes when asked (contracting a's rows
    or b's columns directly, no transposed copy in memory)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def chunks_spec(n: int, c: int, x: int, v_blocked: bool) -> pl.BlockSpec:
    """All N chunks of one (batch, head): [N, C, x] of [N, B, H, C, X] (x = X, or the
    program's V block when v_blocked)."""
    return pl.BlockSpec((n, None, None, c, x), lambda b, h, j: (0, b, h, 0, j if v_blocked else 0))


def tokens_spec(n: int, c: int, vb: int) -> pl.BlockSpec:
    """All N chunks of one (batch, head), V block j, of token-major outputs: [N, C, vb] of
    [B, N, C, H, V] (each chunk's rows are H * V apart: strided, not transposed)."""
    return pl.BlockSpec((None, n, c, None, vb), lambda b, h, j: (b, 0, 0, h, j))


def outputs_spec(n: int, c: int, vb: int, token_major: bool) -> pl.BlockSpec:
    """The spec of o (and of dO): token-major or in the chunk operands' layout."""
    return tokens_spec(n, c, vb) if token_major else chunks_spec(n, c, vb, v_blocked=True)


def outputs_shape(n: int, b: int, h: int, c: int, v: int, token_major: bool) -> tuple:
    """[B, N, C, H, V] (token-major) or [N, B, H, C, V]."""
    return (b, n, c, h, v) if token_major else (n, b, h, c, v)


def decays_spec(n: int, k: int) -> pl.BlockSpec:
    """exp(G_C) of all N chunks of one (batch, head): [N, K] of [N, B, H, K]."""
    return pl.BlockSpec((n, None, None, k), lambda b, h, j: (0, b, h, 0))


def state_spec(k: int, vb: int) -> pl.BlockSpec:
    """The program's V block of one state: [K, vb] of [B, H, K, V]."""
    return pl.BlockSpec((None, None, k, vb), lambda b, h, j: (b, h, 0, j))


def states_spec(n: int, k: int, vb: int) -> pl.BlockSpec:
    """The program's V block of every chunk's start state: [N, K, vb] of [N, B, H, K, V]."""
    return pl.BlockSpec((n, None, None, k, vb), lambda b, h, j: (0, b, h, 0, j))


def shared_specs(n: int, c: int, k: int, plain: bool) -> list:
    """Specs of :meth:`ChunkSteps.shared_operands`: (W_p unless plain, qg, P, K_end,
    exp(G_C)), all of one (batch, head)'s chunks."""
    per_k = chunks_spec(n, c, k, v_blocked=False)
    return [per_k] * (0 if plain else 1) + [
        per_k,
        chunks_spec(n, c, c, False),
        per_k,
        decays_spec(n, k),
    ]
