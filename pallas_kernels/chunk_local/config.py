"""Launch settings of the chunk-local kernels (speed only: every setting gives the same
math, up to the rounding of the dots' precision)."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as pltriton

from pallas_kernels.linear_recurrence.config import DOT_PRECISIONS, MIN_DOT


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class ChunkLocalConfig:
    """Warps and pipeline stages per direction, and the dots' precision for float32
    operands ("tf32", as XLA's f32 matmuls on Hopper, or "ieee"). The defaults, as triton
    3.6 compiles them for sm_90 at C = 64, K = V = 128: 8 warps, forward 112 KiB of shared
    memory and no spills; the backward's two kernels 160 KiB each, the pairs kernel 208
    bytes of spills, the solve kernel none (4 warps: 1.3-1.6 KB of spills each)."""

    forward_warps: int = 8
    backward_warps: int = 8
    stages: int = 1
    dot_precision: str = "tf32"

    def __post_init__(self):
        for name in ("forward_warps", "backward_warps"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(
                f"dot_precision must be one of {tuple(DOT_PRECISIONS)}, got {self.dot_precision!r}"
            )

    @property
    def precision(self):
        return DOT_PRECISIONS[self.dot_precision]

    def compiler_params(self, backward: bool):
        warps = self.backward_warps if backward else self.forward_warps
        return pltriton.CompilerParams(num_warps=warps, num_stages=self.stages)


MAX_CHUNK = 128  # the backward holds several [C, C] and [C, 128] f32 tiles on chip


def check_kernel_shapes(c: int, k: int, v: int) -> None:
    """ValueError naming the dimension unless C, K and V are powers of two >= MIN_DOT (the
    caller pads K and V) and C is at most MAX_CHUNK."""
    for name, n in (("C (chunk)", c), ("K (key dim)", k), ("V (value dim)", v)):
        if n < MIN_DOT or not _power_of_two(n):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT}, got {n}")
    if c > MAX_CHUNK:
        raise ValueError(f"C (chunk) must be at most {MAX_CHUNK}, got {c}")
