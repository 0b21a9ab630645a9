"""dS^'s scales per tile row against one per tile (and rows over 128 keys): gradient errors
against f32 attention.

    PYTHONPATH=. python3 benchmarks/ds_scale_errors.py --out DIR            # CPU, emulation
    PYTHONPATH=. python3 benchmarks/ds_scale_errors.py --implementation pallas --large

For each case and delta mode, the backward under each of ``--scalings`` (SCALINGS:
``rows``, ``NumericsTiles(ds_scale="rows")``: one power-of-two scale per query for dQ, per
key for dK, over 64 x 64 tiles; ``tile``, ``ds_scale="tile"``: one per 64 x 64 tile;
``rows_k128``: rows over 64 x 128 tiles, ``bwd_block_k=128``, so dQ's per-query scales span
128 keys; ``rows_q128_k128``: rows over 128 x 128 tiles, so dK's per-key scales span 128
queries too), each against f32 attention (``benchmarks.correctness.f32_out_and_grads``)
under the same random dO: relative Frobenius and max errors of dQ, dK, dV. Cases: unit-normal inputs,
and "spiky" ones whose queries and keys carry a few large rows (sharp attention rows, so
the tile's amax is far above most of its rows'). Prints a table, writes ds_scale_errors.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

import dm_jax
from benchmarks.correctness import f32_out_and_grads, fro_rel, max_rel
from dm_jax.numerics import DELTA_MODES
from pallas_kernels.fp8_attention.tiles import default_tiles

SCALINGS = {  # name -> NumericsTiles fields changed from the head dims' defaults
    "rows": dict(ds_scale="rows", bwd_block_k=64),
    "tile": dict(ds_scale="tile", bwd_block_k=64),
    "rows_k128": dict(ds_scale="rows", bwd_block_k=128),
    # dK's per-key scales over 128 queries too: what a key pass stepping 128 queries needs
    "rows_q128_k128": dict(ds_scale="rows", bwd_block_q=128, bwd_block_k=128),
}

CASES = {  # name -> (b, t, hq, hkv, d, causal, spiky)
    "d64_causal_gqa": (2, 256, 4, 2, 64, True, False),
    "d128": (1, 256, 2, 2, 128, False, False),
    "d64_spiky": (2, 256, 2, 1, 64, True, True),
}
LARGE = {
    "d128_t4096": (4, 4096, 16, 16, 128, False, False),
    "d128_t4096_causal": (4, 4096, 16, 16, 128, True, False),
    "d128_t4096_spiky": (2, 4096, 16, 8, 128, True, True),
}


def inputs(case, seed=0):
    b, t, hq, hkv, d, _, spiky = case
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q, do = (jax.random.normal(key, (b, t, hq, d)) for key in ks[:2])
    k, v = (jax.random.normal(key, (b, t, hkv, d)) for key in ks[2:4])
    if spiky:  # 1 in 16 query and key rows 8x larger: sharp rows beside flat ones
        q = q * jnp.where(jax.random.uniform(ks[4], (b, t, hq, 1)) < 1 / 16, 8.0, 1.0)
        k = k * jnp.where(jax.random.uniform(ks[5], (b, t, hkv, 1)) < 1 / 16, 8.0, 1.0)
    return q, k, v, do


def measure(name, case, implementation, modes, scalings=tuple(SCALINGS)):
    q, k, v, do = inputs(case)
    causal, d = case[5], case[4]
    ref = f32_out_and_grads(q, k, v, do, causal)[1:]
    rows = []
    for delta in modes:
        for scaling in scalings:
            tiles = dataclasses.replace(default_tiles(d, d), **SCALINGS[scaling])

            def f(q, k, v, delta=delta, tiles=tiles):
                return dm_jax.attention(
                    q, k, v, causal=causal, delta=delta, implementation=implementation, tiles=tiles
                )

            grads = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](do))(q, k, v)
            row = dict(case=name, delta=delta, ds_scale=scaling)
            for field, got, want in zip(("dq", "dk", "dv"), grads, ref):
                row[f"{field}_fro"], row[f"{field}_max"] = fro_rel(got, want), max_rel(got, want)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--implementation", default="reference")
    p.add_argument("--large", action="store_true", help="the GPU's shapes (T = 4096)")
    p.add_argument("--modes", default="matched,stale", help=f"comma-separated of {DELTA_MODES}")
    p.add_argument(
        "--scalings", default=",".join(SCALINGS), help=f"comma-separated of {list(SCALINGS)}"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    scalings = args.scalings.split(",")
    if not set(scalings) <= set(SCALINGS):
        p.error(
            f"--scalings must be a comma-separated subset of {list(SCALINGS)}, "
            f"got {args.scalings!r}"
        )
    if not set(modes) <= set(DELTA_MODES):
        p.error(f"--modes must be a comma-separated subset of {DELTA_MODES}, got {args.modes!r}")
    rows = []
    for name, case in (LARGE if args.large else CASES).items():
        rows += measure(name, case, args.implementation, modes, scalings)
    with open(os.path.join(args.out, "ds_scale_errors.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, argv=sys.argv, rows=rows), f, indent=1)
    print("| case | delta | dS^ scales | dQ fro / max | dK fro / max | dV fro |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['case']} | {r['delta']} | {r['ds_scale']} | {r['dq_fro']:.4e} / "
            f"{r['dq_max']:.3e} | {r['dk_fro']:.4e} / {r['dk_max']:.3e} | {r['dv_fro']:.4e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
