"""Block sizes of the attention kernels, and the defaults per head dim.

The blockwise reference (:mod:`dm_jax.reference`) takes the same block sizes, so the
reference and the kernels can be compared tile for tile. Token tiles must divide the
128-token scale block of Q, K, V and dO (``numerics.SCALE_BLOCK``).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.triton import fp8_accumulation


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
    # How the FP8 dots accumulate on Hopper: "precise" (fp16 mma.sync), "promote32" or
    # "fast" (FP8 wgmma); see fp8_accumulation.py (private JAX API, version-guarded).
    fp8_accumulation: str = "fast"

    def __post_init__(self):
        if self.fp8_accumulation not in fp8_accumulation.MODES:
            raise ValueError(f"fp8_accumulation must be one of {sorted(fp8_accumulation.MODES)}, "
                             f"got {self.fp8_accumulation!r}")
        for name in ("block_q", "block_k", "bwd_block_q", "bwd_block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1) or numerics.SCALE_BLOCK % value:
                raise ValueError(
                    f"{name} must be a power of two in [16, {numerics.SCALE_BLOCK}] "
                    f"(it must divide the {numerics.SCALE_BLOCK}-token scale block), got {value}"
                )


# Measured on the H200 (docs/benchmarks.md "Block sizes per head dim", 2026-11-29, fast
# FP8 accumulation, [4, 4096, 16, D]): widest head dim -> forward (block_q, block_k,
# warps, stages), backward (block_q, block_k, warps, stages). TFLOP/s against the next best
# and the previous default in docs/benchmarks.md.
_TUNED = (
    (64, (64, 128, 4, 3), (64, 64, 4, 3)),
    (128, (64, 128, 4, 3), (64, 64, 4, 2)),
    (192, (64, 64, 4, 3), (64, 32, 4, 2)),  # MLA: Dqk 192, Dv 128
    (256, (64, 64, 4, 3), (64, 64, 8, 2)),
)


def default_block_sizes(head_dim_qk: int, head_dim_v: int) -> BlockSizes:
    """Tiles and launch settings per head dim, from the H200 sweep in ``_TUNED`` (the row of
    the smallest tuned head dim >= the widest of the two)."""
    widest = max(head_dim_qk, head_dim_v)
    for limit, fwd, bwd in _TUNED:
        if widest <= limit:
            break
    return BlockSizes(block_q=fwd[0], block_k=fwd[1], num_warps=fwd[2], num_stages=fwd[3],
                      bwd_block_q=bwd[0], bwd_block_k=bwd[1], bwd_num_warps=bwd[2],
                      bwd_num_stages=bwd[3])
