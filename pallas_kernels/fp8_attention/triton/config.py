"""Launch settings of the Triton backend, their defaults per head dim, and what it runs.

Only speed depends on these; the tiles that change results are the backend-neutral
:class:`..tiles.NumericsTiles` (the Triton kernels launch one program per tile of it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from pallas_kernels.fp8_attention.tiles import head_dim_row
from pallas_kernels.fp8_attention.triton import fp8_accumulation

FP8_ACCUMULATION_MODES = tuple(fp8_accumulation.MODES)  # "precise", "promote32", "fast"
MAX_HEAD_DIM = 256
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Warps and pipeline stages of the forward and of the backward passes (delta, dQ,
    dK/dV), and how the FP8 dots accumulate on Hopper: "precise" (fp16 mma.sync), "promote32"
    or "fast" (FP8 wgmma); see fp8_accumulation.py (private JAX API, version-guarded).

    ``dkdv_keys``: keys per program of the dK/dV pass when dS^ is scaled per tile row
    (``NumericsTiles.ds_scale="rows"``): dK's scales are then per key over the tile's
    queries, so the key width is free (the same bits at any width); capped at the dS
    tile's keys. With per-tile scales the pass takes the dS tile's keys."""

    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    fp8_accumulation: str = "fast"
    dkdv_keys: int = 64

    def __post_init__(self):
        if self.fp8_accumulation not in fp8_accumulation.MODES:
            raise ValueError(
                f"fp8_accumulation must be one of {sorted(fp8_accumulation.MODES)}, "
                f"got {self.fp8_accumulation!r}"
            )
        for name in ("num_warps", "bwd_num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("num_stages", "bwd_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        keys = self.dkdv_keys
        if not isinstance(keys, int) or keys < 16 or keys & (keys - 1):
            raise ValueError(f"dkdv_keys must be a power of two of at least 16, got {keys!r}")


def dkdv_block_k(tiles, config: TritonConfig) -> int:
    """Keys per program of the dK/dV pass for these tiles (TritonConfig.dkdv_keys)."""
    if tiles.ds_scale != "rows":
        return tiles.bwd_block_k
    return min(tiles.bwd_block_k, config.dkdv_keys)


# Measured on the H200 (docs/benchmarks.md "Block sizes per head dim", 2026-11-29, fast FP8
# accumulation, [4, 4096, 16, D]) with the tiles of tiles.py: widest head dim -> forward
# (warps, stages), backward (warps, stages).
_DEFAULTS = (
    (64, (4, 3), (4, 3)),
    (128, (4, 3), (4, 2)),
    (192, (4, 3), (8, 2)),  # MLA: Dqk 192, Dv 128 (64 x 64 dS tiles: 8 warps, 106 TFLOP/s)
    (256, (4, 3), (8, 2)),
)


def default_config(head_dim_qk: int, head_dim_v: int) -> TritonConfig:
    """The default launch settings for these head dims."""
    fwd, bwd = head_dim_row(_DEFAULTS, head_dim_qk, head_dim_v)
    return TritonConfig(
        num_warps=fwd[0], num_stages=fwd[1], bwd_num_warps=bwd[0], bwd_num_stages=bwd[1]
    )


def supported(q_shape, k_shape, v_shape, dtype, spec, config: TritonConfig) -> Optional[str]:
    """None if the Triton kernels run this call, else a sentence saying what they support."""
    del k_shape, config  # every launch setting that passes TritonConfig's checks runs
    dqk, dv = q_shape[-1], v_shape[-1]
    for name, d in (("Dqk", dqk), ("Dv", dv)):
        if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
            return (
                f"{name}={d}: the Triton kernels support head dims that are multiples of "
                f"16 up to {MAX_HEAD_DIM} (tested: 64, 128, 256 and Dqk=192 with Dv=128)"
            )
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {dtype}: the Triton kernels take float32, bfloat16 or float16 inputs"
    tiles = spec.tiles
    if max(dqk, dv) > 128 and max(tiles.block_q, tiles.block_k) > 64:
        return (
            "head dims above 128 need forward tiles of at most 64 tokens "
            "(register pressure); use the default tiles"
        )
    return None
