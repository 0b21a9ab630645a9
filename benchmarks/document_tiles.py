"""Document tiles on the GPU: `MosaicConfig(document_tiles=True)` (the default) against
`document_tiles=False` (every tile visited, and masked once segment ids are given), bit for
bit, on packed documents.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/document_tiles.py --out $OUT

For each shape: the forward's out, then out, dQ, dK and dV of `dm_jax.attention`
(implementation "mosaic", `matched`) with and without document tiles; the largest absolute
difference of each must be 0 (the tiles they leave unmasked would keep every score, the
tiles they skip would add exact zeros). "visited": the share of the forward's tiles they
visit. Timing: `benchmarks/attention.py
--shapes h569m_t4096_docs --arms mosaic_fp8_matched,mosaic_fp8_matched_every_tile`.
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
from pallas_kernels.fp8_attention.mosaic_gpu import documents
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.mosaic_gpu.forward import ForwardMask
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import pad_segment_ids

SHAPES = {  # packed documents at each head dim the training presets use, causal and not
    "h569m_t4096_docs": BENCH_SHAPES["h569m_t4096_docs"],
    "small_t4096_docs": Case("small_t4096_docs", 8, 4096, 4096, 4, 2, 128, 128, segment_len=900),
    "d64_docs": Case("d64_docs", 2, 2048, 2048, 8, 8, 64, 64, segment_len=700),
    "ragged_docs": Case("ragged_docs", 2, 2000, 2000, 8, 2, 128, 128, segment_len=333),
}


def _attention(case: Case, config: MosaicConfig, causal: bool):
    """(attention of q, k, v, the case's q, k, v and dO)."""
    ids = case.segment_ids()[0]

    def attn(q, k, v):
        return dm_jax.attention(
            q, k, v, causal=causal, segment_ids=ids, implementation="mosaic", config=config
        )

    return attn, case.arrays(seed=0, dtype=jnp.bfloat16)


def forward(case: Case, config: MosaicConfig, causal: bool):
    attn, (q, k, v, _) = _attention(case, config, causal)
    return (jax.jit(attn)(q, k, v),)


def gradients(case: Case, config: MosaicConfig, causal: bool):
    attn, (q, k, v, do) = _attention(case, config, causal)

    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out,) + vjp(do)

    return jax.jit(run)(q, k, v, do)


def visited(case: Case, causal: bool):
    """The share of the forward's (CTA, key tile) pairs that document tiles visit, against
    the default (causal: the tiles up to the diagonal)."""
    q_ids, kv_ids = case.segment_ids()
    ids = pad_segment_ids(q_ids, -(-case.t // 128) * 128, -1)
    kv = pad_segment_ids(kv_ids, -(-case.s // 128) * 128, -2)
    mask = ForwardMask(t=case.t, s=case.s, causal=causal, segments=True)
    rows = documents.query_tiles(ids, kv, mask, 128)[:, 0::2]
    n_k = kv.shape[1] // 128
    bound = jnp.arange(rows.shape[1]) + 1 if causal else jnp.full((rows.shape[1],), n_k)
    bound = jnp.minimum(bound, n_k)[None]
    lo = jnp.minimum(rows[..., 2], bound)
    hi = jnp.maximum(jnp.minimum(rows[..., 3], bound), lo)
    return float((hi - lo).sum() / (bound.sum() * rows.shape[0]))


def max_diffs(names, got, want):
    return {
        n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for n, a, b in zip(names, got, want)
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {sorted(SHAPES)}")
    args = p.parse_args(argv)
    print("jax", jax.__version__, jax.devices(), flush=True)
    rows = []
    path = os.path.join(args.out, "document_tiles.json")
    for name in args.shapes.split(","):
        for causal in (True, False):
            case = SHAPES[name]
            row = dict(case=name, causal=causal, visited=visited(case, causal))
            # the forward alone first: a failure names its kernel
            for stage, run, names in (
                ("forward", forward, ("out",)),
                ("backward", gradients, ("out", "dq", "dk", "dv")),
            ):
                print(f"{name} causal={causal}: {stage}", flush=True)
                want = run(case, MosaicConfig(document_tiles=False), causal)
                got = run(case, MosaicConfig(document_tiles=True), causal)
                row[stage] = max_diffs(names, got, want)
                row[f"{stage}_finite"] = all(bool(jnp.all(jnp.isfinite(x))) for x in got)
            print(json.dumps(row), flush=True)
            rows.append(row)
            with open(path, "w") as f:  # after every case: a crash keeps the rows before it
                json.dump(
                    dict(
                        jax=jax.__version__,
                        rows=rows,
                        shapes=[dataclasses.asdict(SHAPES[n]) for n in args.shapes.split(",")],
                    ),
                    f,
                    indent=1,
                )
    print("| shape | causal | tiles visited | max abs diff fwd out; out / dq / dk / dv | finite |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        d, f = r["backward"], r["forward"]
        finite = r["forward_finite"] and r["backward_finite"]
        print(
            f"| {r['case']} | {r['causal']} | {r['visited']:.0%} | {f['out']}; {d['out']} / "
            f"{d['dq']} / {d['dk']} / {d['dv']} | {finite} |"
        )


if __name__ == "__main__":
    main()
