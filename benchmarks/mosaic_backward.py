"""The Mosaic GPU backward's passes under several launch settings, on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mosaic_backward.py --out $OUT

For each variant (``--stages``: the backward's shared-memory stages; ``--delta-key-tiles``:
keys per step of the matched-delta pass; ``--dq-key-tiles``: keys per step of the dQ pass,
the dS scale tile's keys, ``NumericsTiles.bwd_block_k``: 128 gives dQ's dS^ one scale per
query over 128 keys, a numerics change, so its ``max_rel_diff`` is not 0; ``--pingpong``: the consumer warpgroups take turns
on the tensor cores; ``--wide-launches``: how head dims over 128 split the dQ and dK/dV
passes; ``--causal-orders``: the launch order of causal query tiles, which also times the
forward kernel) and causality: the matched-delta pass, the dQ pass and the dK/dV pass of a
benchmark shape (``--shape``, default main), each timed on its own like
benchmarks/passes.py, with their TFLOP/s (2, 3 and 4 matmuls of the shape's size, whatever
the launches recompute), and each result's largest difference from the first variant's
(``max_rel_diff``: 0 where the variant must be bitwise equal, as ``--pingpong``,
``--wide-launches`` and ``--causal-orders`` are). A delta key tile other than the first
times the delta pass only.
Writes mosaic_backward.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.passes import time_fn
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES
from pallas_kernels.fp8_attention.mosaic_gpu import ops
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles

PASSES = ("delta_matched_kernel", "dq_pass", "dkdv_pass")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--stages", default="2,3", help="comma-separated backward stages")
    p.add_argument(
        "--delta-key-tiles",
        default="128",
        help="comma-separated keys per matched-delta step (the first one times every pass)",
    )
    p.add_argument(
        "--dq-key-tiles",
        default="64",
        help="comma-separated keys per dQ step (NumericsTiles.bwd_block_k; others time dQ only)",
    )
    p.add_argument(
        "--pingpong",
        default="0",
        help="comma-separated 0/1: the consumer warpgroups take turns on the tensor cores",
    )
    p.add_argument(
        "--wide-launches",
        default=MosaicConfig().backward_wide_launches,
        help="comma-separated MosaicConfig.backward_wide_launches (head dims over 128)",
    )
    p.add_argument(
        "--causal-orders",
        default=MosaicConfig().causal_order,
        help="comma-separated MosaicConfig.causal_order (the first also times the forward)",
    )
    p.add_argument("--shape", default="main", choices=sorted(BENCH_SHAPES))
    p.add_argument("--causal", default="0,1")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shape in interpret mode (CPU)")
    args = p.parse_args(argv)
    rows = []
    start = time.time()
    for causal in [bool(int(c)) for c in args.causal.split(",")]:
        case = dataclasses.replace(BENCH_SHAPES[args.shape], causal=causal)
        if args.smoke:
            case = case.shrunk()
        q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
        spec = AttentionSpec(
            causal=causal,
            delta="matched",
            precision="fp8",
            sm_scale=case.dqk**-0.5,
            tiles=default_tiles(case.dqk, case.dv),
        )
        dq_tiles = [int(x) for x in args.dq_key_tiles.split(",")]
        one = 2 * case.b * case.hq * case.t * case.s * case.dqk * (0.5 if causal else 1.0)
        tiles = [int(x) for x in args.delta_key_tiles.split(",")]
        turns = [bool(int(x)) for x in args.pingpong.split(",")]
        wides = args.wide_launches.split(",")
        orders = args.causal_orders.split(",")
        # the forward kernel too where the launch order varies
        all_passes = PASSES if len(orders) == 1 else ("forward_kernel",) + PASSES
        # each setting's first value, varied one setting at a time (the row's keys)
        base = dict(
            stages=int(args.stages.split(",")[0]),
            delta_key_tile=tiles[0],
            dq_key_tile=dq_tiles[0],
            pingpong=turns[0],
            wide_launches=wides[0],
            causal_order=orders[0],
        )
        variants = [(dict(base, stages=int(n)), all_passes) for n in args.stages.split(",")]
        variants += [(dict(base, delta_key_tile=tile), PASSES[:1]) for tile in tiles[1:]]
        variants += [(dict(base, dq_key_tile=tile), PASSES[1:2]) for tile in dq_tiles[1:]]
        variants += [(dict(base, pingpong=pp), PASSES) for pp in turns[1:]]
        variants += [(dict(base, wide_launches=w), PASSES[1:]) for w in wides[1:]]
        variants += [(dict(base, causal_order=o), all_passes[:3]) for o in orders[1:]]
        first = {}  # pass name -> the first variant's result
        for fields, names in variants:
            config = MosaicConfig(
                backward_stages=fields["stages"],
                fused_quantize=not args.smoke,
                delta_key_tile=fields["delta_key_tile"],
                backward_pingpong=fields["pingpong"],
                backward_wide_launches=fields["wide_launches"],
                causal_order=fields["causal_order"],
            )
            variant = dict(causal=causal, **fields)
            tiles_here = dataclasses.replace(spec.tiles, bwd_block_k=fields["dq_key_tile"])
            spec_here = dataclasses.replace(spec, tiles=tiles_here)
            try:
                plan = ops.passes(q, k, v, do, spec=spec_here, config=config, interpret=args.smoke)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(variant, error=str(e)[:500]))
                continue
            for name in names:
                fn, fargs, matmuls = plan[name]
                row = dict(variant, name=name)
                try:  # the result, against the first variant's (pingpong: bitwise equal)
                    result = jax.jit(fn)(*fargs)
                    row["max_rel_diff"] = max_rel_diff(result, first.setdefault(name, result))
                    sec = time_fn(fn, fargs, args.iters, args.reps)
                    row.update(ms=sec * 1e3, tflops=matmuls * one / sec / 1e12)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(os.path.join(args.out, "mosaic_backward.json"), "w") as f:
        info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows)
        json.dump(dict(info, seconds=time.time() - start), f, indent=1)
    print(
        f"{args.shape}: | causal | stages | delta key tile | dQ key tile | pingpong | wide launches "
        "| causal order | pass "
        "| ms | TFLOP/s | vs first |"
    )
    for r in rows:
        print(
            f"| {r['causal']} | {r['stages']} | {r['delta_key_tile']} | {r['dq_key_tile']} | "
            f"{r['pingpong']} | "
            f"{r['wide_launches']} | {r['causal_order']} | "
            f"{r.get('name', '-')} | {r.get('ms', float('nan')):.3f} | "
            f"{r.get('tflops', float('nan')):.0f} | {r.get('max_rel_diff', float('nan')):.1e} | "
            f"{r.get('error', '')[:60]}"
        )


def max_rel_diff(result, reference) -> float:
    """Largest |result - reference| over each array's largest |reference|, over the arrays
    of a pass's result (None entries skipped)."""
    pairs = zip(jax.tree.leaves(result), jax.tree.leaves(reference))
    diffs = [
        jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
        / jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30)
        for a, b in pairs
    ]
    return max((float(d) for d in diffs), default=0.0)


if __name__ == "__main__":
    main()
