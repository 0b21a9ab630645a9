"""The Mosaic GPU attention layer (with packed documents, where the shape has them) under
variants of how its backward's loops are written, on the GPU: ptxas' spills, kernel times, and the bits.

    MOSAIC_GPU_DUMP_PTXAS=1 PYTHONUNBUFFERED=1 PYTHONPATH=. \\
        python3 benchmarks/key_pass_variants.py --shape small_t8192_docs --out $OUT 2>&1

Each variant's kernels compile after a line ``=== variant NAME``, so ptxas' report (printed
by the compiler on the same stream) falls under its variant. Variants:

- ``default``: each loop of a CTA over its tiles in three pieces (masked, unmasked inside
  the document, masked: ``forward.document_loops``); the key pass writes them out per query
  head of its kv head.
- ``masked_documents``: the backward's loops in one masked piece over the same tiles (the
  CTA's range is still cut to its documents; only the unmasked fast path goes), so the key
  pass holds one step body per head instead of three. Bitwise the default: a masked step
  whose pairs all lie in one document keeps every score.
- ``every_tile``: ``MosaicConfig(document_tiles=False)``, every tile visited and masked.
- ``pieces64`` / ``pieces128``: the backward's dots into fresh accumulators of 64 or 128
  columns (``MosaicConfig(backward_piece_columns=...)``; the default takes 64 with segment
  ids, 128 without): a 64-column result holds half the registers beside the dK and dV
  accumulators. Bitwise the same: each column's sum is formed the same way.
- ``early_p``: each backward step forms P as soon as its S dot is done, while the dP^ dot
  still runs (``MosaicConfig(backward_early_p=True)``). Bitwise the same.
- ``ds_tile``: one dS^ scale per 64 x 64 tile (``NumericsTiles(ds_scale="tile")``, the
  default until 2026-12-04) instead of one per tile row, which takes a cross-warp amax.
  Not bitwise: a numerics change, whose error against f32 ``benchmarks/attention.py``
  reports (arm suffix ``_ds_tile``). ``early_p_ds_tile``: both.
- ``dq128``: dS scale tiles of 64 x 128 (``NumericsTiles(bwd_block_k=128)``): dQ's dS^ one
  scale per query over 128 keys, so the dQ pass steps 128 keys (half the steps, barriers
  and factor loads per matmul). dK and dV bitwise the default's; dQ a numerics change
  (arm suffix ``_dq128`` in ``benchmarks/attention.py``). ``dq128_pieces64``: the same with
  the backward's dots in 64-column pieces (fewer live registers beside dQ's accumulator).
  The default at head dims up to 128 since 2026-12-07; ``dq64``: the 64 x 64 tiles of before.
- ``chained``: each step's register dots (dV's and dK's in the key pass, dQ's in the dQ
  pass) as one chain of 64-column pieces, two in flight, each piece's adds under the next
  piece's dot (``MosaicConfig(backward_chained_dots=True)``). Bitwise the same.
- ``kregs`` / ``kvregs``: the key pass's S^T dot (and dP^T's) takes K (and V) from
  registers, loaded once per CTA (``MosaicConfig(backward_key_registers="k" / "kv")``).
  Bitwise the same. ``chained_kregs``, ``chained_kvregs``: with ``chained``.
- ``qregs`` / ``qdoregs``: the query passes' S dot (and dP^'s) takes Q (and dO) from
  registers (``MosaicConfig(backward_query_registers="q" / "qdo")``). Bitwise the same.
- ``regs240``: every warp-specialized kernel's consumers at 240 registers per thread and
  its producer at 24 (``forward.CONSUMER_REGISTERS`` / ``PRODUCER_REGISTERS``), the default
  since 2026-12-07; ``regs232``: 232 / 40, the split before. ``regs240_chained``,
  ``regs240_kregs``: with ``chained`` / ``kregs``.

Per variant: microseconds per step by kernel kind (`benchmarks/layer_kernels.py`), and the
largest difference of dQ, dK, dV from the default's. Writes key_pass_variants.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import dm_jax
from benchmarks.attention import fwdbwd_step
from benchmarks.layer_kernels import profile_arm
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES
from pallas_kernels.fp8_attention.mosaic_gpu import backward, forward
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles


def masked_loops(step, bounds, carry):
    """``forward.document_loops``' range in one masked loop."""
    return lax.fori_loop(bounds[0], bounds[3], functools.partial(step, masked=True), carry)


@contextlib.contextmanager
def patched(name: str):
    """The backward as variant ``name`` has it, for the block's traces."""
    original = backward.document_loops
    registers = forward.CONSUMER_REGISTERS, forward.PRODUCER_REGISTERS
    if name == "masked_documents":
        backward.document_loops = masked_loops
    if name.startswith("regs240"):  # every warp-specialized kernel, the forward's too
        forward.CONSUMER_REGISTERS, forward.PRODUCER_REGISTERS = 240, 24
    if name == "regs232":  # the split until 2026-12-07
        forward.CONSUMER_REGISTERS, forward.PRODUCER_REGISTERS = 232, 40
    try:
        yield
    finally:
        backward.document_loops = original
        forward.CONSUMER_REGISTERS, forward.PRODUCER_REGISTERS = registers


VARIANTS = {
    "default": MosaicConfig(),
    "masked_documents": MosaicConfig(),
    "every_tile": MosaicConfig(document_tiles=False),
    "pieces64": MosaicConfig(backward_piece_columns=64),
    "pieces128": MosaicConfig(backward_piece_columns=128),
    "early_p": MosaicConfig(backward_early_p=True),
    "ds_tile": MosaicConfig(),
    "early_p_ds_tile": MosaicConfig(backward_early_p=True),
    "dq128": MosaicConfig(),
    "dq64": MosaicConfig(),
    "dq128_pieces64": MosaicConfig(backward_piece_columns=64),
    "chained": MosaicConfig(backward_chained_dots=True),
    "kregs": MosaicConfig(backward_key_registers="k"),
    "kvregs": MosaicConfig(backward_key_registers="kv"),
    "chained_kregs": MosaicConfig(backward_chained_dots=True, backward_key_registers="k"),
    "chained_kvregs": MosaicConfig(backward_chained_dots=True, backward_key_registers="kv"),
    "qregs": MosaicConfig(backward_query_registers="q"),
    "qdoregs": MosaicConfig(backward_query_registers="qdo"),
    "regs240": MosaicConfig(),
    "regs232": MosaicConfig(),
    "regs240_chained": MosaicConfig(backward_chained_dots=True),
    "regs240_kregs": MosaicConfig(backward_key_registers="k"),
}
# variants that change the numbers: NumericsTiles fields beside the head dims' defaults
TILE_FIELDS = {
    "ds_tile": dict(ds_scale="tile", bwd_block_k=64),
    "early_p_ds_tile": dict(ds_scale="tile", bwd_block_k=64),
    "dq128": dict(bwd_block_k=128),
    "dq64": dict(bwd_block_k=64),
    "dq128_pieces64": dict(bwd_block_k=128),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small_t8192_docs", choices=sorted(BENCH_SHAPES))
    p.add_argument("--causal", default="1", choices=("0", "1"))
    p.add_argument("--mha", action="store_true", help="as many kv heads as query heads")
    p.add_argument("--segment-len", type=int, help="tokens per document (default: the shape's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=3, help="profiled calls per variant")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    case = dataclasses.replace(BENCH_SHAPES[args.shape], causal=args.causal == "1")
    if args.mha:
        case = dataclasses.replace(case, hkv=case.hq, name=case.name + "_mha")
    if args.segment_len is not None:
        case = dataclasses.replace(
            case, segment_len=args.segment_len, name=f"{case.name}_{args.segment_len}"
        )
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    ids = case.segment_ids()
    rows, first = [], None
    for name in args.variants.split(","):
        jax.clear_caches()  # dm_jax.attention's jit would reuse the last variant's kernels
        print(f"=== variant {name}", flush=True)
        sys.stderr.flush()

        tiles = dataclasses.replace(default_tiles(case.dqk, case.dv), **TILE_FIELDS.get(name, {}))

        def attention(q, k, v, config=VARIANTS[name], tiles=tiles):
            return dm_jax.attention(
                q,
                k,
                v,
                causal=case.causal,
                segment_ids=ids,
                implementation="mosaic",
                config=config,
                tiles=tiles,
            )

        step = fwdbwd_step(attention)
        with patched(name):
            grads = jax.jit(step)(q, k, v, do)
            row = dict(variant=name, case=case.name, causal=case.causal)
            first = first or grads
            row["max_abs_diff"] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(grads, first)
            )
            row.update(profile_arm(step, (q, k, v, do), args.steps))
        print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
        rows.append(row)
        with open(os.path.join(args.out, "key_pass_variants.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, argv=sys.argv, rows=rows), f, indent=1)
    print(
        f"| {case.name}, causal {int(case.causal)}, us per step | "
        + " | ".join(r["variant"] for r in rows)
        + " |"
    )
    kinds = sorted({k for r in rows for k in r["us_by_kind"]})
    for kind in kinds:
        vals = " | ".join(f"{r['us_by_kind'].get(kind, 0):,.1f}" for r in rows)
        print(f"| {kind} | {vals} |")
    print("| all kernels | " + " | ".join(f"{r['kernel_us']:,.1f}" for r in rows) + " |")
    print(
        "| max abs diff from default | "
        + " | ".join(f"{r['max_abs_diff']:.1e}" for r in rows)
        + " |"
    )


if __name__ == "__main__":
    main()
