"""Where the time goes: each pass of our attention timed on its own, on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/passes.py --out $OUT

Passes (main benchmark shape, non-causal unless --causal 1): the quantize pre-passes of
the forward and the backward, the forward kernel, the matched-delta kernel, the stale row
dot, the dQ pass and the dK/dV pass; in FP8 (each accumulation mode of --modes) and bf16.
Each is jitted on its own inputs and timed like benchmarks/attention.py (a fori_loop
with a dependency between iterations, median of reps). TFLOP/s counts the pass's dots:
forward 2, delta 2, dQ 3, dK/dV 4 matmuls of 2 T S D FLOPs each (causal: half).
Writes passes.json.
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

from pallas_kernels.fp8_attention.triton import backward as bk
from pallas_kernels.fp8_attention.triton import delta as dl
from pallas_kernels.fp8_attention.triton import forward as fw
from pallas_kernels.fp8_attention.triton import ops
from pallas_kernels.fp8_attention.triton.common import MaskSpec
from pallas_kernels.fp8_attention.triton.config import default_block_sizes
from pallas_kernels.fp8_attention.triton.quantize import quantize
from benchmarks.attention import run_timed
from tests.shapes import BENCH_MAIN

F32 = jnp.float32


def time_fn(fn, args, iters, reps):
    """Median seconds of fn(*args); every iteration perturbs (by 0) the first 16- or
    32-bit float leaf, so the loop cannot hoist the call."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    first = next(i for i, x in enumerate(leaves)
                 if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 2)

    def loop(leaves):
        def body(_, carry):
            acc, leaves = carry
            out = fn(*jax.tree_util.tree_unflatten(tree, leaves))
            acc = acc + sum(jnp.sum(o[..., :1, :1].astype(F32)) for o in jax.tree_util.tree_leaves(out))
            leaves = list(leaves)
            x = leaves[first]
            leaves[first] = x + (acc * 0).astype(x.dtype)
            return acc, leaves

        return jax.lax.fori_loop(0, iters, body, (jnp.zeros((), F32), leaves))[0]

    return run_timed(loop, leaves, iters, reps)[0]


def passes(case, precision, accumulation, interpret=False):
    """name -> (fn, args, matmuls counted) for one precision and FP8 accumulation mode."""
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    bs = dataclasses.replace(default_block_sizes(case.dqk, case.dv), fp8_accumulation=accumulation)
    mask = MaskSpec(t=case.t, s=case.s, causal=case.causal, segments=False, padded=False)
    sm = case.dqk ** -0.5
    kw = dict(mask=mask, sm_scale=sm, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
              num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages, interpret=interpret,
              fp8_accumulation=accumulation)
    q8, k8, v8f = quantize(q, precision), quantize(k, precision), quantize(v, precision, k_major=True)
    o, lse = ops.forward(q, k, v, causal=case.causal, sm_scale=sm, precision=precision,
                         block_sizes=bs, interpret=interpret)
    bq8, bk8 = quantize(q, precision, k_major=True), quantize(k, precision, k_major=True)
    bv8, bdo8 = quantize(v, precision), quantize(do, precision, k_major=True)
    delta = dl.matched_delta(bq8, bk8, bv8, bdo8, lse, None, None, **kw)
    fwd_kernel = lambda q8, k8, v8: fw.forward(
        q8, k8, v8, mask=mask, sm_scale=sm, precision=precision, block_q=bs.block_q,
        block_k=bs.block_k, num_warps=bs.num_warps, num_stages=bs.num_stages,
        out_dtype=jnp.bfloat16, interpret=interpret, fp8_accumulation=accumulation)
    return {
        "quantize_fwd": (lambda q, k, v: (quantize(q, precision), quantize(k, precision),
                                          quantize(v, precision, k_major=True)), (q, k, v), 0),
        "forward_kernel": (fwd_kernel, (q8, k8, v8f), 2),
        "quantize_bwd": (lambda q, k, v, do: (quantize(q, precision, k_major=True),
                                              quantize(k, precision, k_major=True),
                                              quantize(v, precision),
                                              quantize(do, precision, k_major=True)), (q, k, v, do), 0),
        "delta_matched_kernel": (lambda *a: dl.matched_delta(*a, None, None, **kw),
                                 (bq8, bk8, bv8, bdo8, lse), 2),
        "delta_stale_rowdot": (lambda do, o: dl.row_dot_delta("stale", do, o, bdo8, case.t), (do, o), 0),
        "dq_pass": (lambda *a: bk.dq_pass(*a, None, None, precision=precision, **kw)[0],
                    (bq8, bk8, bv8, bdo8, lse, delta), 3),
        "dkdv_pass": (lambda *a: bk.dkdv_pass(*a, None, None, precision=precision, **kw),
                      (bq8, bk8, bv8, bdo8, lse, delta), 4),
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=150.0)
    p.add_argument("--modes", default="precise,promote32,fast",
                   help="FP8 accumulation modes to time (bf16 runs once, after them)")
    p.add_argument("--smoke", action="store_true", help="tiny shape in interpret mode (CPU)")
    args = p.parse_args(argv)
    start = time.time()
    case = dataclasses.replace(BENCH_MAIN, causal=bool(args.causal))
    if args.smoke:
        case = case.shrunk()
    one_matmul = 2 * case.b * case.hq * case.t * case.s * case.dqk * (0.5 if case.causal else 1.0)
    rows = []
    runs = [("fp8", m) for m in args.modes.split(",") if m] + [("bf16", "precise")]
    for precision, mode in runs:
        try:
            plan = passes(case, precision, mode, interpret=args.smoke)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(precision=precision, mode=mode, error=f"{type(e).__name__}: {str(e)[:500]}"))
            continue
        for name, (fn, fargs, matmuls) in plan.items():
            if time.time() - start > args.budget:
                rows.append(dict(precision=precision, mode=mode, name=name, error="skipped: time budget"))
                continue
            row = dict(precision=precision, mode=mode, name=name, causal=case.causal)
            try:
                sec = time_fn(fn, fargs, args.iters, args.reps)
                row["ms"] = sec * 1e3
                if matmuls:
                    row["tflops"] = matmuls * one_matmul / sec / 1e12
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, f"passes{'_causal' if case.causal else ''}.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, shape=[case.b, case.t, case.hq, case.dqk],
                       rows=rows, seconds=time.time() - start), f, indent=1)
    print("| precision | pass | ms | TFLOP/s |")
    for r in rows:
        print(f"| {r['precision']} {r.get('mode', '')} | {r.get('name', '-')} | "
              f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} | {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
