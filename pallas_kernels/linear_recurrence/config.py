"""Launch settings of the state-pass kernels (speed only: every setting gives the same math,
up to the rounding of the dots' precision)."""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.pallas import triton as pltriton

MIN_DOT = 16  # smallest Triton dot side (tl.dot): C, K and the V block are at least this

# the Triton dot's input precision for float32 operands: tf32 (tensor cores; XLA's default
# for f32 matmuls on Hopper, so the sequential pass's class) or ieee (full f32 on the FMA
# units: a precision check, compiled for sm_90 with kilobytes of register spills)
DOT_PRECISIONS = {"tf32": jax.lax.Precision.DEFAULT, "ieee": jax.lax.Precision.HIGHEST}


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class StatePassConfig:
    """block_v: V columns per program (V blocks are independent in both directions; each
    program reads the chunk operands that span K whole, so V / block_v programs read them).
    Warps and pipeline stages per direction. The defaults fit Hopper as compiled by triton
    3.6 for sm_90 at K = V = 128, C = 64 (timed on the H200: docs/models.md): one stage,
    80 KiB of shared memory per block, 8 warps (no register spills forward, 104 bytes
    backward); two stages need 264-320 KiB, over Hopper's 227 KiB per block. block_v 32 with
    4 warps needs 56 KiB and about 210 registers a thread, no spills: two programs per SM.

    token_major_outputs: the forward writes o, and the backward reads dO, token-major
    ([B, N * C, H, V], the layout the model reads the mixer's output in) instead of in the
    chunk operands' [N, B, H, C, V]; the backward then writes dO's chunk-layout copy for its
    batched matmuls itself. Either way the same values: it moves the transposes XLA would
    otherwise run on o and dO (134 MB of float32 each per GDN layer at 569m, 8 x 4096) into
    the kernels' strided loads and stores."""

    block_v: int = 64
    forward_warps: int = 8
    forward_stages: int = 1
    backward_warps: int = 8
    backward_stages: int = 1
    dot_precision: str = "tf32"
    token_major_outputs: bool = True

    def __post_init__(self):
        if not _power_of_two(self.block_v) or self.block_v < MIN_DOT:
            raise ValueError(f"block_v must be a power of two >= {MIN_DOT}, got {self.block_v}")
        for name in ("forward_warps", "backward_warps"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        for name in ("forward_stages", "backward_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(
                f"dot_precision must be one of {tuple(DOT_PRECISIONS)}, got {self.dot_precision!r}"
            )

    @property
    def precision(self):
        """lax precision of the kernels' dots (the Triton lowering maps DEFAULT to tf32 and
        HIGHEST to ieee; in interpret mode on a CPU both run in full f32)."""
        return DOT_PRECISIONS[self.dot_precision]

    def compiler_params(self, backward: bool):
        """Triton lowering settings of one direction (without them Pallas would pick Mosaic
        GPU on a GPU)."""
        warps, stages = (
            (self.backward_warps, self.backward_stages)
            if backward
            else (self.forward_warps, self.forward_stages)
        )
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def kernel_size(n: int) -> int:
    """The size a dimension of n is padded to for the kernels: a power of two >= MIN_DOT."""
    return max(MIN_DOT, 1 << (n - 1).bit_length())


MAX_COMPILED_CHUNK = 128  # C = 256 (K = 128) needs 320-352 KiB of shared memory (sm_90)


def check_kernel_shapes(c: int, k: int, v: int, config: StatePassConfig, compiled: bool) -> None:
    """ValueError naming the dimension unless C, K and V fit the Triton blocks (powers of
    two >= MIN_DOT; V is then a multiple of the V block or smaller than it) and, for the
    compiled kernels, the chunk's operand tiles fit a Hopper block's shared memory."""
    for name, n in (("C (chunk)", c), ("K (key dim)", k), ("V (value dim)", v)):
        if n != kernel_size(n):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT}, got {n} (pad it)")
    if compiled and c > MAX_COMPILED_CHUNK:
        raise ValueError(
            f"C (chunk) must be at most {MAX_COMPILED_CHUNK} for the compiled kernels, got {c}: "
            "larger chunks' operand tiles exceed the shared memory of a block"
        )
