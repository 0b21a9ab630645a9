"""Tile math shared by every attention kernel, so that all passes compute bitwise the same
S, P and dP^ for a given (query tile, key tile).

Notation (one head): hats are decoded FP8 operands, ``inv`` the per-token decode factors
(constant over a tile, powers of two, so every rescaling below is exact):
    S   = (Q^ K^^T) * (scale * inv_q * inv_k)      [bq, bk], -inf where masked
    dP^ = (dO^ V^^T) * (inv_do * inv_v)            [bq, bk]
The orientation of both dots ([bq x D] @ [D x bk]) is the same in every pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_attention.triton import fp8_accumulation

F32 = jnp.float32


class MaskSpec(NamedTuple):
    """Static mask settings of one call (real lengths, causality, segments present)."""

    t: int
    s: int
    causal: bool
    segments: bool
    padded: bool = True  # T or S was padded up to the tile multiple (bounds must be masked)

    @property
    def every_tile(self) -> bool:
        """Every tile needs the mask (segments or padding), not only the causal diagonal."""
        return self.segments or self.padded


def compiler_params(num_warps: int, num_stages: int):
    """Triton lowering settings (without them Pallas would pick Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def kernel_name(base: str, accumulation: str) -> str:
    """pallas_call name: the FP8 accumulation mode's suffix, which the lowering hook of
    :mod:`.fp8_accumulation` acts on (the precise path has none)."""
    suffix = fp8_accumulation.suffix(accumulation)
    if suffix:
        fp8_accumulation.install()
    return base + suffix


def dot_nt(a, b):
    """a @ b^T with f32 accumulation: a [m, d], b [n, d] (both contract their last dim)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def dot_tt(a, b):
    """a^T @ b^T with f32 accumulation: a [k, m], b [n, k] (b is a K-major copy)."""
    return jax.lax.dot_general(a, b, (((0,), (1,)), ((), ())), preferred_element_type=F32)


def tile_scalar(inv_vec):
    """The one decode factor of a tile from its per-token vector (all entries are equal,
    but for NaN on poisoned tokens: quantize.with_poison; max skips them)."""
    return jnp.max(jnp.where(inv_vec == inv_vec, inv_vec, 0.0))


def valid_mask(mask: MaskSpec, q_pos, k_pos, q_seg: Optional[jax.Array], k_seg):
    """[bq, bk] bool: inside both real lengths, causal (k <= q), same segment."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    valid = (qp < mask.t) & (kp < mask.s)
    if mask.causal:
        valid = valid & (qp >= kp)
    if mask.segments:
        valid = valid & (q_seg[:, None] == k_seg[None, :])
    return valid


def scores(q8, k8, inv_q, inv_k, sm_scale, valid):
    """S = (Q^ K^^T) * (scale * inv_q * inv_k), -inf where masked (``valid`` None: no mask).

    [bq, bk] f32. Skipping the mask on a tile where it is all True gives the same bits.
    """
    raw = dot_nt(q8, k8)
    s = raw * ((sm_scale * inv_q)[:, None] * inv_k[None, :])
    return s if valid is None else jnp.where(valid, s, -jnp.inf)


def dp_hat(do8, v8, inv_do, inv_v):
    """dP^ = (dO^ V^^T) * (inv_do * inv_v): the FP32 result of the FP8 dot.  [bq, bk]."""
    raw = dot_nt(do8, v8)
    return raw * (inv_do[:, None] * inv_v[None, :])


def probs_and_dp(q8, inv_q, k8, inv_k, do8, inv_do, v8, inv_v, lse, valid, sm_scale):
    """Recomputed P = exp(S - lse) (0 where masked) and dP^ of one (query, key) tile pair."""
    p = jnp.exp(scores(q8, k8, inv_q, inv_k, sm_scale, valid) - lse[:, None])
    return p, dp_hat(do8, v8, inv_do, inv_v)


def positions(block_index, block):
    return block_index * block + jnp.arange(block, dtype=jnp.int32)


def causal_key_blocks(q_block_index, block_q, block_k, n_k, mask: MaskSpec):
    """Number of key tiles a query tile visits (causal: tiles past the diagonal are skipped)."""
    if not mask.causal:
        return n_k
    return jnp.minimum(n_k, pl.cdiv((q_block_index + 1) * block_q, block_k))


def key_loop(body, init, q_block_index, block_q, block_k, n_k, mask: MaskSpec):
    """``carry = body(j, carry, masked)`` over the key tiles query tile i sees.

    Causal without segments or padding: the tiles wholly below the diagonal (every key
    <= the tile's first query) run without the mask, the diagonal tiles with it.
    """
    upper = causal_key_blocks(q_block_index, block_q, block_k, n_k, mask)
    if not mask.causal or mask.every_tile:
        return lax.fori_loop(
            0, upper, functools.partial(body, masked=mask.causal or mask.every_tile), init
        )
    n_full = jnp.minimum(upper, (q_block_index * block_q + 1) // block_k)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), init)
    return lax.fori_loop(n_full, upper, functools.partial(body, masked=True), carry)


def query_loop(body, init, k_block_index, block_q, block_k, n_q, mask: MaskSpec):
    """``carry = body(i, carry, masked)`` over the query tiles that see key tile j.

    Causal: starts at the first query tile that sees key tile j; without segments or
    padding, tiles wholly below the diagonal (every query >= the tile's last key) skip
    the mask.
    """
    if not mask.causal:
        return lax.fori_loop(0, n_q, functools.partial(body, masked=mask.every_tile), init)
    first = (k_block_index * block_k) // block_q
    if mask.every_tile:
        return lax.fori_loop(first, n_q, functools.partial(body, masked=True), init)
    full_from = jnp.minimum(n_q, pl.cdiv((k_block_index + 1) * block_k - 1, block_q))
    carry = lax.fori_loop(first, full_from, functools.partial(body, masked=True), init)
    return lax.fori_loop(full_from, n_q, functools.partial(body, masked=False), carry)


class Dims(NamedTuple):
    b: int
    hq: int
    tp: int  # padded queries
    dqk: int  # padded head dims
    hkv: int
    sp: int  # padded keys
    dv: int
    group: int  # query heads per kv head


def dims(q, k, v) -> Dims:
    """Sizes of quantized operands q [B, Hq, Tp, Dqk], k [B, Hkv, Sp, Dqk], v [.., Sp, Dv]."""
    b, hq, tp, dqk = q.values.shape
    hkv, sp = k.values.shape[1], k.values.shape[2]
    dv = v.values.shape[3] if v.values is not None else v.values_t.shape[2]
    return Dims(b, hq, tp, dqk, hkv, sp, dv, hq // hkv)


class QueryGridSpecs:
    """BlockSpecs of a pass whose grid is (query tile, batch, query head).

    Query-side tensors are [B, Hq, Tp, ...] and read one tile per program; key-side
    tensors are [B, Hkv, Sp, ...] and read whole (the kernel loops over key tiles); query
    head h reads kv head h // group.
    """

    def __init__(self, block_q: int, group: int):
        self.block_q, self.group = block_q, group

    def q_tile(self, d):  # [B, Hq, Tp, d] -> [bq, d]
        return pl.BlockSpec((None, None, self.block_q, d), lambda i, b, h: (b, h, i, 0))

    def q_rows(self):  # [B, Hq, Tp] -> [bq]
        return pl.BlockSpec((None, None, self.block_q), lambda i, b, h: (b, h, i))

    def kv_whole(self, n0, n1):  # [B, Hkv, n0, n1] -> [n0, n1]
        g = self.group
        return pl.BlockSpec((None, None, n0, n1), lambda i, b, h: (b, h // g, 0, 0))

    def kv_rows(self, sp):  # [B, Hkv, Sp] -> [Sp]
        g = self.group
        return pl.BlockSpec((None, None, sp), lambda i, b, h: (b, h // g, 0))

    def segments(self, sp):  # q_seg [B, Tp] -> [bq], kv_seg [B, Sp] -> [Sp]
        return [
            pl.BlockSpec((None, self.block_q), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, sp), lambda i, b, h: (b, 0)),
        ]
