"""Launch settings of the Mosaic GPU backend, their default per head dim, and what it runs.

The tiles that change results are fixed by the kernel's design, not by this config: 128
query rows per CTA (two consumer warpgroups of 64), 128-key tiles (one scale block of the
numerics contract, so one K and one V decode factor per tile).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from pallas_kernels.fp8_attention.mosaic_gpu import backward as bwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel
from pallas_kernels.fp8_attention.triton import config as triton_config

TESTED_HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
MIN_JAX = (0, 11)
CAUSAL_ORDERS = ("grid", "longest_first")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """K/V shared-memory stages of the forward (reduced to what fits shared memory), and
    whether the quantize pre-pass runs as one Pallas kernel (head dims that are powers of
    two) or as XLA ops (bitwise the same operands).

    The backward runs in this backend's kernels (``mosaic_backward``, with up to
    ``backward_stages`` tile stages, fewer where shared memory is short) where they support
    the call (head dims up to 128, or up to 256 with ``backward_wide_heads``; a 64 x 64 dS
    scale tile), else in the Triton passes with the ``backward`` launch settings (None:
    Triton's default for the head dims).
    ``backward_wide_heads``: head dims over 128 (256, 192/128 with a 64 x 64 dS tile) in
    this backend's backward, one dQ and one dK/dV launch per 128 columns, each recomputing S
    and dP^. On by default: on the H200 fwd+bwd takes 8.4 against 18.8 ms at 192/128 and
    18.4 against 27.1 ms at 256 with the Triton passes (docs/mosaic_gpu.md); False sends
    those head dims to the Triton passes.
    ``delta_key_tile``: keys per step of the matched-delta pass, 64 or 128 (it forms no dS,
    so it is not bound to the 64 x 64 dS scale tile; P and dP^ are bitwise the same, delta
    sums them in another order). 128 is the default: 724 against 580 TFLOP/s on the H200
    (docs/mosaic_gpu.md).
    ``backward_pingpong``: the backward passes' two consumer warpgroups take turns on the
    tensor cores (one's dS math under the other's dots, as in the forward); results are
    bitwise the same. Off: slower on the H200 in every pass, the dK/dV pass 1.9x
    (`benchmarks/mosaic_backward.py --pingpong 0,1`, docs/mosaic_gpu.md).
    ``quantize_warps``: warps per program of the fused quantize kernel (one [128, D] tile
    each): 16, the fastest of 4, 8 and 16 for both pre-passes on the H200 (forward 0.205,
    backward 0.276 ms at [4, 4096, 16, 128]: ``benchmarks/quantize_speed.py``).
    ``backward_dq``: where the Mosaic backward forms dQ. ``"pass"`` (default): its own
    pass over the key tiles of each query block, deterministic. ``"key_pass"``: inside the
    dK/dV pass, one more FP8 dot per tile whose [64, D] f32 result is added to dQ in global
    memory by a TMA reduce-add; this drops the dQ pass and its recomputed S and dP^ dots,
    but the adds of the key blocks land in any order, so dQ is not bitwise reproducible
    run to run (the same numerics otherwise; the dS statistics of ``with_stats`` still run
    the dQ pass).
    ``backward_wide_launches``: how head dims over 128 split the dQ and dK/dV passes.
    ``"per_chunk"``: one dQ and one dK/dV launch per 128 columns, each recomputing S and dP^
    and forming dS. ``"per_gradient"``: one dQ launch over every column, one dV launch (S^T
    and the dV dot only: no dP^T, no dS) and one dK launch, each adding its dot in 128-column
    pieces (a fresh accumulator each, so the results are bitwise ``"per_chunk"``'s): the dS
    math runs once per tile in each pass instead of once per chunk.
    ``causal_order``: the launch order of a causal call's query tiles in the forward and the
    query passes. ``"longest_first"`` (default): per batch, the tiles that see the most keys
    first, so fewer long CTAs run alone at the end of a launch (FlashAttention-3's order).
    ``"grid"``: the grid's own order (the tiles that see the fewest keys first). The results
    are bitwise the same; on the H200 longest-first took the causal forward 5-14% and the
    query passes 6-9% faster (docs/mosaic_gpu.md, "Causal launch order"). Pallas' GPU
    interpreter (``mosaic_interpret``) runs the same order.
    ``document_tiles`` (default on): with segment ids whose real ids ascend along each row
    (packed documents), each CTA visits only the tiles whose ids can meet its own (the
    others are wholly masked and would add exact zeros), and the tiles that lie wholly
    inside the document of their query rows (and, causal, below the diagonal) take the
    unmasked path instead of the masked one (:mod:`.documents`). The results are bitwise
    the same (checked on the H200, forward and gradients); the forward, both query passes
    and the key pass read their bounds from small int32 arrays computed in XLA. On the
    H200, the 569m layer at 8 x 4096 with documents of 1,500 tokens took 2.56 ms instead of
    4.15 fwd+bwd (docs/mosaic_gpu.md, "Document tiles"). ``False``: every tile, masked.
    ``backward_piece_columns``: columns of each fresh FP8 dot's f32 accumulator in the
    backward passes (dK, dV, dQ; 64 or 128). 0 (default): 64 in calls with segment ids,
    128 without, as measured on the H200: with documents the 64-column pieces hold half
    the registers beside the dK and dV accumulators and took the D=128 key pass from 892
    to 604 us (ptxas spills 2,436 -> 832 bytes), without segment ids they cost 2-4% at
    D=128 and 9% at D=256 (docs/mosaic_gpu.md, "What a CTA pays once, and dots in 64-column
    pieces"). The results are bitwise the same.
    ``shared_quantize``: where the Mosaic backward runs, the forward quantizes Q, K and V
    with exactly the backward's calls (values and permuted K-major copies of all three), so
    that XLA can merge each forward call with its backward twin (identical side-effect-free
    custom calls on the same inputs) instead of quantizing Q, K and V twice per step. XLA
    does merge them where the forward and backward share one program: on the H200 the
    `small` layer at 8 x 8192 with documents ran 22 kernel launches instead of 25 and its
    quantize pre-passes took 123 instead of 187 us (all kernels 1,721 against 1,787 us;
    docs/mosaic_gpu.md, "The backward's schedules"), so it is on by default. The forward
    then keeps the K-major copies for the backward (one byte per element of Q, K and V
    more between the passes). Where the two are separate programs (a layer scan's
    forward and backward loops) nothing merges and the forward writes copies it does not
    read (not timed). The results are bitwise the same.
    ``backward_early_p``: in every backward pass each step issues its S and dP^ dots
    together and forms P as soon as the S dot is done, while the dP^ dot still runs (one
    ``wgmma.wait_group`` per dot instead of one for both). The results are bitwise the same.
    The dS^ scales follow the call's ``NumericsTiles.ds_scale`` (one per tile row by
    default, which needs no cross-warp amax; or one per tile). dQ from the key pass
    (``backward_dq="key_pass"``) needs one per tile, its dQ dot contracting the keys:
    with row scales the dQ pass runs instead.
    ``backward_chained_dots``: the register dots of each backward step (dV's and dK's in
    the key pass, dQ's in the dQ pass) run as one chain of 64-column pieces with two in
    flight, each piece's FP32 adds while the next piece's dot runs, instead of each dot
    waited for before its adds. The results are bitwise the same (each piece's dot and
    adds are unchanged). Off: on an H100 the key pass spilled 432 bytes and ran 15%
    slower (21% causal), the dQ pass within noise (docs/mosaic_gpu.md, "Two dots in
    flight").
    ``backward_key_registers``: the key pass's S^T = K Q^T dot takes its A operand (the
    warpgroup's 64 keys) from registers, loaded once per CTA, instead of reading it from
    shared memory in every step (``"k"``; ``"kv"``: also V for dP^T = V dO^T; ``""``:
    neither). At N = 64 queries an FP8 dot with both operands in shared memory reads
    them as fast as the tensor cores use them, so this halves the dots' shared-memory
    reads, for 16 registers a tile. The same products. Off: on an H100 ``"k"`` ran the
    key pass 3-5% slower without more spills, ``"kv"`` 9-11% with 232 bytes of spills.
    ``backward_query_registers``: the same for the query passes (matched delta and dQ):
    ``"q"``: the S = Q K^T dot's Q from registers; ``"qdo"``: dP^ = dO V^T's dO too. Off:
    2-9% slower on an H100 (``"qdo"`` spills 256 bytes, 1,076 causal)."""

    stages: int = 2
    fused_quantize: bool = True
    mosaic_backward: bool = True
    backward_stages: int = 2
    backward: Optional[triton_config.TritonConfig] = None
    delta_key_tile: int = 128
    backward_pingpong: bool = False
    backward_wide_heads: bool = True
    document_tiles: bool = True
    quantize_warps: int = quantize_kernel.WARPS
    backward_dq: str = "pass"
    backward_wide_launches: str = "per_gradient"
    causal_order: str = "longest_first"
    backward_piece_columns: int = 0
    shared_quantize: bool = True
    backward_early_p: bool = False
    backward_chained_dots: bool = False
    backward_key_registers: str = ""
    backward_query_registers: str = ""

    def __post_init__(self):
        for name in ("stages", "backward_stages"):
            if not 1 <= getattr(self, name) <= 4:
                raise ValueError(f"{name} must be in [1, 4], got {getattr(self, name)}")
        if self.quantize_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"quantize_warps must be 1, 2, 4, 8 or 16, got {self.quantize_warps}")
        if self.backward_dq not in ("pass", "key_pass"):
            raise ValueError(f"backward_dq must be 'pass' or 'key_pass', got {self.backward_dq!r}")
        if self.backward_wide_launches not in bwd_kernel.WIDE_LAUNCHES:
            choices = " or ".join(map(repr, bwd_kernel.WIDE_LAUNCHES))
            raise ValueError(
                f"backward_wide_launches must be {choices}, got {self.backward_wide_launches!r}"
            )
        if self.causal_order not in CAUSAL_ORDERS:
            choices = " or ".join(map(repr, CAUSAL_ORDERS))
            raise ValueError(f"causal_order must be {choices}, got {self.causal_order!r}")
        if self.backward_piece_columns not in (0, 64, 128):
            raise ValueError(
                f"backward_piece_columns must be 0 (auto), 64 or 128, got "
                f"{self.backward_piece_columns}"
            )
        if self.backward_key_registers not in ("", "k", "kv"):
            raise ValueError(
                f"backward_key_registers must be '', 'k' or 'kv', got "
                f"{self.backward_key_registers!r}"
            )
        if self.backward_query_registers not in ("", "q", "qdo"):
            raise ValueError(
                f"backward_query_registers must be '', 'q' or 'qdo', got "
                f"{self.backward_query_registers!r}"
            )
        if self.delta_key_tile not in (64, 128):
            raise ValueError(f"delta_key_tile must be 64 or 128, got {self.delta_key_tile}")

    def backward_config(self, head_dim_qk: int, head_dim_v: int) -> triton_config.TritonConfig:
        if self.backward is not None:
            return self.backward
        return triton_config.default_config(head_dim_qk, head_dim_v)


def default_config(head_dim_qk: int, head_dim_v: int) -> MosaicConfig:
    """Two stages everywhere (measured on the H200: three gave no gain at D=128,
    docs/mosaic_gpu.md); D=256 drops to the stages that fit (one)."""
    del head_dim_qk, head_dim_v
    return MosaicConfig(stages=2)


def supported(q_shape, k_shape, v_shape, dtype, spec, config: MosaicConfig) -> Optional[str]:
    """None if the Mosaic GPU kernels run this call, else a sentence saying what they run."""
    import jax

    precision = spec.precision
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < MIN_JAX:
        return f"needs jax >= {'.'.join(map(str, MIN_JAX))} (this is jax {jax.__version__})"
    if precision != "fp8":
        return f"precision={precision!r}: the Mosaic GPU kernels run precision='fp8' only"
    dqk, dv = q_shape[-1], v_shape[-1]
    if dqk % 64 or dv % 64 or max(dqk, dv) > 256:
        return (
            f"head dims ({dqk}, {dv}): the Mosaic GPU kernels take multiples of 64 up to 256 "
            f"(tested: {', '.join(f'{a}/{b}' for a, b in TESTED_HEAD_DIMS)})"
        )
    if jnp.dtype(dtype) not in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        return f"dtype {dtype}: the Mosaic GPU kernels take float32, bfloat16 or float16 inputs"
    if fwd_kernel.smem_bytes(1, dqk, dv, dtype) > fwd_kernel.SMEM_BYTES:
        return (
            f"a {jnp.dtype(dtype).name} output tile of head dim {dv} does not fit shared memory "
            f"with the Q, K and V^T tiles; use bfloat16 inputs"
        )
    backward = config.backward_config(dqk, dv)
    return triton_config.supported(q_shape, k_shape, v_shape, dtype, spec, backward)
