"""Block specs and the in-kernel chunk math shared by the forward and backward kernels.

Layouts: Q, K, V and their gradients token-major, viewed as [B, N, C, H, X] (a reshape of
[B, T, H, X]: each chunk's rows are H * X apart, strided, not transposed); the gates g, b
and their gradients [B, N, C, H]; segment ids and the carried mask [B, N, C]; the state
pass's operands and their cotangents in the chunk layout [N, B, H, C, X]. The grid is
(B, N, H), one program per chunk of one head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_recurrence.common import F32, dot  # noqa: F401 (re-exported)


def tokens_spec(c: int, x: int) -> pl.BlockSpec:
    """One chunk of one head, [C, x] of [B, N, C, H, X]."""
    return pl.BlockSpec((None, None, c, None, x), lambda b, n, h: (b, n, 0, h, 0))


def gates_spec(c: int) -> pl.BlockSpec:
    """One chunk of one head's gate, [C] of [B, N, C, H]."""
    return pl.BlockSpec((None, None, c, None), lambda b, n, h: (b, n, 0, h))


def positions_spec(c: int) -> pl.BlockSpec:
    """One chunk's segment ids or carried mask, [C] of [B, N, C] (shared by the heads)."""
    return pl.BlockSpec((None, None, c), lambda b, n, h: (b, n, 0))


def chunk_spec(c: int, x: int) -> pl.BlockSpec:
    """One chunk of one head, [C, x] of [N, B, H, C, X]."""
    return pl.BlockSpec((None, None, None, c, x), lambda b, n, h: (n, b, h, 0, 0))


def _iotas(c: int):
    r = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    return r, jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)


def chunk_decays(g_C, seg_C, carried_C):
    """(dec [C, C], gam [C], dec_last [C]) of one chunk: Dec_rj = exp(G_r - G_j) for j <= r
    in one document, else 0 (G_r = sum_{s<=r} g_s); gam_r = exp(G_r) * carried_r; dec_last
    = Dec_{C-1, j}, the decays K_end and S' use."""
    c = g_C.shape[0]
    r, j = _iotas(c)
    G = jnp.sum(jnp.where(j <= r, g_C[None, :], 0.0), axis=1)  # cumulative sum as a masked sum
    same = (j <= r) & (seg_C[:, None] == seg_C[None, :])
    dec = jnp.exp(jnp.where(same, G[:, None] - G[None, :], -jnp.inf))
    dec_last = jnp.sum(jnp.where(r == c - 1, dec, 0.0), axis=0)
    return dec, jnp.exp(G) * carried_C, dec_last


def strictly_lower(x_CC):
    r, j = _iotas(x_CC.shape[0])
    return jnp.where(j < r, x_CC, 0.0)


DIAGONAL_BLOCK = 16  # the inverse's diagonal blocks, solved by substitution


def unit_lower_inverse(A_CC, dot_fn):
    """(I + A)^-1 for strictly lower-triangular A, C a multiple of DIAGONAL_BLOCK.

    1. The diagonal 16 x 16 blocks by forward substitution, all at once: X <- I - A_bd X,
       15 times (after n steps the first n + 1 rows of every block are exact, each formed
       from exact rows only), giving D = (I + A_bd)^-1.
    2. I + A = (I + A_bd)(I + N) with N = D A_off, strictly block-lower (C / 16 blocks), so
       (I + A)^-1 = (I + N)^-1 D = (I - N)(I + N^2)(I + N^4) ... D.
    Not the series (I - A)(I + A^2)(I + A^4) ... over A itself: for keys that point alike
    (K K^T near 1) A^16 reaches 1e16 and the sum cancels to garbage even in f32; here the
    largest power is of N, whose blocks already carry D's cancellation.
    """
    c = A_CC.shape[0]
    r, j = _iotas(c)
    eye = jnp.where(r == j, 1.0, 0.0)
    same_block = (r // DIAGONAL_BLOCK) == (j // DIAGONAL_BLOCK)
    A_diag = jnp.where(same_block, A_CC, 0.0)
    D = eye - A_diag
    for _ in range(2, DIAGONAL_BLOCK):
        D = eye - dot_fn(A_diag, D)
    blocks = c // DIAGONAL_BLOCK
    if blocks == 1:
        return D
    N = dot_fn(D, jnp.where(same_block, 0.0, A_CC))
    inv = eye - N
    for _ in range(1, (blocks - 1).bit_length()):
        N = dot_fn(N, N)
        inv = inv + dot_fn(inv, N)
    return dot_fn(inv, D)


def reverse_cumsum(x_C):
    """y_j = sum_{r >= j} x_r: the transpose of the forward's cumulative sum."""
    r, j = _iotas(x_C.shape[0])
    return jnp.sum(jnp.where(r >= j, x_C[:, None], 0.0), axis=0)
