"""Block sizes of the attention kernels, and the defaults per head dim.

The blockwise reference (:mod:`dm_jax.reference`) takes the same block sizes, so the
reference and the kernels can be compared tile for tile. Token tiles must divide the
128-token scale block of Q, K, V and dO (``dm_jax.numerics.SCALE_BLOCK``).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (tokens) of the forward and backward passes, plus launch settings."""

    block_q: int = 64
    block_k: int = 64
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    # Hopper's FP8 tensor-core path with reduced-precision accumulation inside each tile's
    # dot (fast_accumulation.py; private JAX API, version-guarded). The kernels get their
    # own names, so they never share a compilation cache entry with precise ones.
    fast_accumulation: bool = False
    # One backward kernel per key tile that also adds each tile's dQ contribution into an
    # f32 dQ with atomic adds (fused_backward.py): S and dP^ are recomputed once instead of
    # twice. Off by default until it is timed on the GPU; the dS row statistics
    # (``with_stats``) always take the two-pass path.
    fused_backward: bool = False

    def __post_init__(self):
        # imported here: dm_jax imports the kernels, which import this module
        from dm_jax import numerics

        for name in ("block_q", "block_k", "bwd_block_q", "bwd_block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1) or numerics.SCALE_BLOCK % value:
                raise ValueError(
                    f"{name} must be a power of two in [16, {numerics.SCALE_BLOCK}] "
                    f"(it must divide the {numerics.SCALE_BLOCK}-token scale block), got {value}"
                )


def default_block_sizes(head_dim_qk: int, head_dim_v: int) -> BlockSizes:
    """Tiles per head dim: smaller tiles for larger heads (register pressure).

    Head dim 128 is the one measured (H200, docs/benchmarks.md, 2026-11-29): forward
    128 x 128 tiles, 8 warps, 3 stages gave 160 TFLOP/s against 141 for 128 x 64 / 2 stages
    (64 x 64 / 4 warps: 139; 128 x 64 / 4 warps: 121); backward 64 x 128 tiles were slower
    than 64 x 64 (68 against 105 TFLOP/s fwd+bwd). The other rows are unmeasured guesses.
    """
    widest = max(head_dim_qk, head_dim_v)
    if widest <= 64:
        return BlockSizes(block_q=128, block_k=64, bwd_block_q=64, bwd_block_k=64)
    if widest <= 128:
        return BlockSizes(block_q=128, block_k=128, bwd_block_q=64, bwd_block_k=64,
                          num_warps=8, num_stages=3)
    return BlockSizes(block_q=64, block_k=32, bwd_block_q=32, bwd_block_k=32, num_warps=8)
