"""Document tiles on the GPU: `MosaicConfig(document_tiles=True)` against the default
(every tile masked once segment ids are given), bit for bit, on packed documents.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/document_tiles.py --out $OUT

For each shape: out, dQ, dK and dV of `dm_jax.attention` (implementation "mosaic",
`matched`) with and without document tiles; the largest absolute difference of each must
be 0 (the tiles they leave unmasked would keep every score). Timing: `benchmarks/attention.py
--shapes h569m_t4096_docs --arms mosaic_fp8_matched,mosaic_fp8_matched_document_tiles`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import dm_jax
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES, Case
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig

SHAPES = {  # packed documents at each head dim the training presets use, causal and not
    "h569m_t4096_docs": BENCH_SHAPES["h569m_t4096_docs"],
    "small_t4096_docs": Case("small_t4096_docs", 8, 4096, 4096, 4, 2, 128, 128, segment_len=900),
    "d64_docs": Case("d64_docs", 2, 2048, 2048, 8, 8, 64, 64, segment_len=700),
    "ragged_docs": Case("ragged_docs", 2, 2000, 2000, 8, 2, 128, 128, segment_len=333),
}


def gradients(case: Case, config: MosaicConfig, causal: bool):
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    ids = case.segment_ids()[0]

    def attn(q, k, v):
        return dm_jax.attention(
            q, k, v, causal=causal, segment_ids=ids, implementation="mosaic", config=config
        )

    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out,) + vjp(do)

    return jax.jit(run)(q, k, v, do)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {sorted(SHAPES)}")
    args = p.parse_args(argv)
    print("jax", jax.__version__, jax.devices(), flush=True)
    rows = []
    for name in args.shapes.split(","):
        for causal in (True, False):
            case = SHAPES[name]
            want = gradients(case, MosaicConfig(), causal)
            got = gradients(case, MosaicConfig(document_tiles=True), causal)
            diffs = {
                n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)
            }
            finite = all(bool(jnp.all(jnp.isfinite(x))) for x in got)
            row = dict(case=name, causal=causal, max_abs_diff=diffs, finite=finite)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "document_tiles.json"), "w") as f:
        json.dump(
            dict(
                jax=jax.__version__,
                rows=rows,
                shapes=[dataclasses.asdict(SHAPES[n]) for n in args.shapes.split(",")],
            ),
            f,
            indent=1,
        )
    print("| shape | causal | max abs diff out / dq / dk / dv | finite |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        d = r["max_abs_diff"]
        print(
            f"| {r['case']} | {r['causal']} | {d['out']} / {d['dq']} / {d['dk']} / {d['dv']} | {r['finite']} |"
        )


if __name__ == "__main__":
    main()
