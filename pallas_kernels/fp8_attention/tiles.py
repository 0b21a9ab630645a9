"""The tiles that change results: backend-neutral, honoured by every backend.

FP8 attention has two kinds of tile sizes. Launch settings (warps, stages, how a backend
splits work among warps) change speed only; they live in each backend's config
(``triton/config.py``, ``mosaic_gpu/config.py``). The sizes below change the numbers:

* ``SCALE_BLOCK`` (128 tokens, :mod:`.numerics`): one power-of-two scale per (batch, head,
  block) of Q, K, V and dO. Fixed: every token tile divides it.
* ``bwd_block_q x bwd_block_k``: the dS scale tile. dS = P (dP^ - delta) gets dynamic
  power-of-two scales per (query tile, key tile) before its FP8 cast; the matched delta's
  pre-pass forms dP^ on the same tiles. ``ds_scale`` says how many: ``"rows"`` (default
  since 2026-12-04) one per row of the tile along each gradient's output, so the scale is
  constant along the dot's contraction: per query (over the tile's keys) for dQ = dS^ K,
  per key (over the tile's queries) for dK = dS^^T Q, so dQ and dK cast dS each in their
  own way; ``"tile"`` one per tile, the same dS^ for both. A backend must use exactly these
  scales (its own compute tile may be larger if it applies them per sub-tile).
* ``block_q x block_k``: the forward tiles. They decide the order of the online-softmax
  updates (FP32 rounding only); the pure-JAX emulation (``dm_jax.reference``) mirrors them so
  a backend that uses them matches it to FP32 rounding, tile for tile.

The emulation takes a :class:`NumericsTiles`; so does every backend (``AttentionSpec.tiles``).
The defaults per head dim come from the H200 sweep in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.fp8_attention import numerics


# dS^'s scales: one per row of each dS scale tile along the gradient's output (per query
# for dQ, per key for dK), or one per tile. On the H200 the rows took the Mosaic backward's
# kernels at [4, 4096, 16, 128] from 5.06 to 4.78 ms (no cross-warp amax), errors against
# f32 equal to three digits (docs/numerics.md, "dS scales per tile row").
DS_SCALES = ("rows", "tile")


@dataclasses.dataclass(frozen=True)
class NumericsTiles:
    """Token tiles (forward and backward) that define the numbers of one attention call.

    Each is a power of two in [16, SCALE_BLOCK], so it divides the 128-token scale block.
    ``ds_scale``: one of DS_SCALES (module docstring).
    """

    block_q: int = 64
    block_k: int = 64
    bwd_block_q: int = 64  # dS scale tile: queries
    bwd_block_k: int = 64  # dS scale tile: keys
    ds_scale: str = "rows"

    def __post_init__(self):
        if self.ds_scale not in DS_SCALES:
            choices = " or ".join(map(repr, DS_SCALES))
            raise ValueError(f"ds_scale must be {choices}, got {self.ds_scale!r}")
        for name in ("block_q", "block_k", "bwd_block_q", "bwd_block_k"):
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or value < 16
                or value & (value - 1)
                or numerics.SCALE_BLOCK % value
            ):
                raise ValueError(
                    f"{name} must be a power of two in [16, {numerics.SCALE_BLOCK}] "
                    f"(it must divide the {numerics.SCALE_BLOCK}-token scale block), got {value!r}"
                )

    @property
    def ds_tile(self) -> tuple:
        """(queries, keys) of one dS scale."""
        return self.bwd_block_q, self.bwd_block_k


# Widest head dim -> forward (block_q, block_k), backward (bwd_block_q, bwd_block_k).
# Measured on the H200 with the Triton backend (docs/benchmarks.md "Block sizes per head
# dim", 2026-11-29, [4, 4096, 16, D]); the launch settings of the same sweep are in
# triton/config.py.
_DEFAULTS = (
    # dS scale tiles of 64 x 128 at head dims up to 128 (since 2026-12-07): dQ's per-query
    # scales over one K scale block, so the Mosaic dQ pass steps 128 keys (3-6% faster
    # fwd+bwd, the same errors against f32); the Triton backward pays 5-6% (its dQ pass
    # at 128 keys; its dK/dV pass keeps 64 keys per program, TritonConfig.dkdv_keys).
    # docs/mosaic_gpu.md, "64 x 128 dS tiles end to end" and "The default since 2026-12-07".
    (64, (64, 128), (64, 128)),
    (128, (64, 128), (64, 128)),
    # MLA: Dqk 192, Dv 128. The dS tile is 64 x 64 (the Mosaic backward's; 2.2x faster
    # fwd+bwd than the Triton passes on the H200), not the Triton backward's best 64 x 32
    # (111 against 106 TFLOP/s there): docs/mosaic_gpu.md, "Head dims over 128".
    (192, (64, 64), (64, 64)),
    (256, (64, 64), (64, 64)),
)


def head_dim_row(table, head_dim_qk: int, head_dim_v: int) -> tuple:
    """The entries of the row of ``table`` ((limit, *entries) rows, limits ascending) with
    the smallest limit >= the widest head dim (the last row for wider ones, which no Pallas
    backend runs). Every default table per head dim is read this way."""
    widest = max(head_dim_qk, head_dim_v)
    return next((row for row in table if widest <= row[0]), table[-1])[1:]


def default_tiles(head_dim_qk: int, head_dim_v: int) -> NumericsTiles:
    """The default tiles for these head dims."""
    fwd, bwd = head_dim_row(_DEFAULTS, head_dim_qk, head_dim_v)
    return NumericsTiles(block_q=fwd[0], block_k=fwd[1], bwd_block_q=bwd[0], bwd_block_k=bwd[1])


def ds_scale_axes(ds_scale: str) -> tuple:
    """(dQ's, dK's) amax axes of a [.., queries, keys] dS tile for ``ds_scale``: the keys
    and the queries for ``"rows"`` (each gradient's rows get their own scale), both for
    ``"tile"``."""
    if ds_scale not in DS_SCALES:
        raise ValueError(f"ds_scale must be one of {DS_SCALES}, got {ds_scale!r}")
    return ((-1,), (-2,)) if ds_scale == "rows" else ((-2, -1), (-2, -1))
