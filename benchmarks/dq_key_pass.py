"""dQ from the dK/dV pass (``MosaicConfig(backward_dq="key_pass")``) against the dQ pass,
on the GPU, through the public op's gradients (bf16 inputs, FP8 `matched` by default).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/dq_key_pass.py --out $OUT

Per shape: the largest difference of dQ from the dQ pass's (relative to its largest
entry), whether dK and dV are bitwise the same (they must be), and how far two runs of the
key-pass dQ differ (the reduce-add's order changes run to run). Speed: benchmarks/attention.py's
``mosaic_fp8_matched_dq_key_pass`` arm. Writes dq_key_pass.json.
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


# GQA 16/4 with packed documents of 1,000 tokens (the last one ragged)
GQA_SEGMENTS = Case("gqa_seg", 1, 4096, 4096, 16, 4, 128, 128, segment_len=1000)


def grads(case, q, k, v, do, config, implementation):
    ids = None
    if case.segment_len:
        ids = jnp.broadcast_to(jnp.arange(case.t) // case.segment_len, (case.b, case.t))

    def loss(q, k, v):
        out = dm_jax.attention(
            q, k, v, causal=case.causal, delta=case.delta, precision="fp8",
            segment_ids=ids, implementation=implementation, config=config,
        )  # fmt: skip
        return jnp.vdot(out.astype(jnp.float32), do)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def compare(case, implementation="mosaic", seed=0) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (case.b, case.t, case.hq, case.dqk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (case.b, case.s, case.hkv, case.dqk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (case.b, case.s, case.hkv, case.dv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (case.b, case.t, case.hq, case.dv), jnp.float32)
    dq_pass, dk_pass, dv_pass = grads(case, q, k, v, do, MosaicConfig(), implementation)
    key_pass = MosaicConfig(backward_dq="key_pass")
    dq, dk, dv = grads(case, q, k, v, do, key_pass, implementation)
    dq_again = grads(case, q, k, v, do, key_pass, implementation)[0]
    scale = float(jnp.max(jnp.abs(dq_pass.astype(jnp.float32))))
    rel = lambda a, b: (
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) / scale
    )  # noqa: E731
    return dict(
        shape=case.name,
        causal=case.causal,
        dq_vs_pass=rel(dq, dq_pass),
        dq_run_to_run=rel(dq, dq_again),
        dk_dv_bitwise=bool(jnp.all(dk == dk_pass)) and bool(jnp.all(dv == dv_pass)),
        dq_finite=bool(jnp.all(jnp.isfinite(dq))),
    )


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="main,gqa_seg,d64,d256,d192_128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--smoke", action="store_true", help="a tiny shape in interpret mode (CPU)")
    args = p.parse_args(argv)
    shapes = dict(BENCH_SHAPES, gqa_seg=GQA_SEGMENTS)
    rows = []
    if args.smoke:
        cases = [Case("smoke", 1, 128, 128, 1, 1, 64, 64)]
        implementation = "mosaic_interpret"
    else:
        cases = [
            dataclasses.replace(shapes[name], causal=bool(int(c)))
            for name in args.shapes.split(",")
            for c in args.causal.split(",")
        ]
        implementation = "mosaic"
    for case in cases:
        try:
            rows.append(compare(case, implementation))
        except Exception as e:  # record, keep going
            rows.append(dict(shape=case.name, causal=case.causal, error=repr(e)[:300]))
        print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dq_key_pass.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1)
    print("| shape | causal | dQ vs dQ pass | dQ run to run | dK, dV bitwise | finite |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['causal']} | error: {r['error'][:80]} | | | |")
            continue
        print(
            f"| {r['shape']} | {r['causal']} | {r['dq_vs_pass']:.1e} | {r['dq_run_to_run']:.1e} "
            f"| {r['dk_dv_bitwise']} | {r['dq_finite']} |"
        )


if __name__ == "__main__":
    main()
