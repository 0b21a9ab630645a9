"""Short GPU probes: FP8 casts on the device, fast-accumulation row sums, block sizes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tune.py --out $OUT --budget 55

1. XLA's f32 -> E4M3 cast on the GPU (numerics.quantize under jit) against ml_dtypes'
   round-to-nearest-even cast on the host: number of differing codes.
2. Matched pre-cast dS row sums with the fast FP8 accumulation path (lever off by default).
3. Forward / forward+backward time of the FP8 matched kernels for a few block sizes at the
   main benchmark shape (timing as benchmarks/attention.py), and of the fused backward
   (BlockSizes.fused_backward) against the default two-pass backward.
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
import ml_dtypes
import numpy as np

import dm_jax
from dm_jax import numerics
from dm_jax.attention import AttentionConfig
from dm_jax.backends import BACKENDS
from pallas_kernels.fp8_attention.config import BlockSizes, default_block_sizes
from pallas_kernels.fp8_attention.fast_accumulation import fast_fp8_accumulation
from tests.shapes import BENCH_MAIN, Case
from benchmarks.attention import fwd_step, fwdbwd_step, time_step


def cast_check():
    x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32) * 50.0
    scale = np.float32(2.0)
    got = np.asarray(jax.jit(lambda x: numerics.quantize(x, scale))(x)).view(np.uint8)
    want = np.clip(x * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return dict(values=int(x.size), differing=int(np.sum(got != want)))


def fastacc_rowsums(max_num_imprecise_acc=None, implementation="pallas"):
    t, h = (2048, 16) if implementation == "pallas" else (256, 2)  # else: a CPU smoke check
    case = Case("rows", 2, t, t, h, h, 128, 128, causal=True)
    q, k, v, do = case.arrays(seed=0)
    bs = dataclasses.replace(default_block_sizes(128, 128), fast_accumulation=True)
    cfg = AttentionConfig(True, "matched", "fp8", 128 ** -0.5, implementation, bs)
    kern = BACKENDS[implementation]
    with fast_fp8_accumulation(True, max_num_imprecise_acc) as on:
        out, lse = jax.jit(lambda q, k, v: kern.forward(q, k, v, None, None, config=cfg))(q, k, v)
        g = jax.jit(lambda *a: kern.backward(*a, None, None, config=cfg))(q, k, v, out, lse, do)
    r = jnp.abs(g.ds_rowsum_pre) / jnp.where(g.ds_abssum_pre == 0, 1.0, g.ds_abssum_pre)
    return dict(patched=bool(on), pre_max=float(jnp.max(r)), pre_median=float(jnp.median(r)))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget", type=float, default=55.0)
    p.add_argument("--set", default="blocks", choices=("blocks", "accumulation"),
                   help="blocks: block sizes (and the two checks); accumulation: default vs fast vs promotion every 32 products "
                        "(max_num_imprecise_acc), fwd and fwd+bwd, with matched row sums")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: [1, 256, 2 heads] shapes, interpret mode")
    args = p.parse_args(argv)
    impl = "pallas_interpret" if args.smoke else "pallas"
    main_case = dataclasses.replace(BENCH_MAIN, b=1, t=256, s=256, hq=2, hkv=2) if args.smoke else BENCH_MAIN
    start = time.time()
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "set": args.set}
    checks = ((("cast_check", cast_check), ("fastacc_rowsums", lambda: fastacc_rowsums(None, impl)))
              if args.set == "blocks" else ())
    for name, fn in checks:
        try:
            res[name] = fn()
        except Exception as e:
            traceback.print_exc()
            res[name] = f"{type(e).__name__}: {str(e)[:500]}"
        print(name, res[name], flush=True)
    variants = [
        ("default", False, default_block_sizes(128, 128), True),
        ("default", True, default_block_sizes(128, 128), True),
        ("default_fastacc", False, dataclasses.replace(default_block_sizes(128, 128), fast_accumulation=True), True),
        ("q128_k128_w8_s3", False, BlockSizes(128, 128, 64, 64, 8, 3, 4, 2), False),
        ("q64_k64_w4_s3", False, BlockSizes(64, 64, 64, 64, 4, 3, 4, 2), False),
        ("q128_k64_w4_s3", False, BlockSizes(128, 64, 64, 64, 4, 3, 4, 2), False),
        ("bwd_q64_k128_w8", False, BlockSizes(128, 64, 64, 128, 8, 2, 8, 2), True),
    ]
    fused = dataclasses.replace(default_block_sizes(128, 128), fused_backward=True)
    variants += [("default_fused_bwd", False, fused, True), ("default_fused_bwd", True, fused, True)]
    imprecise = {}  # variant name -> max_num_imprecise_acc for the fast kernels
    if args.set == "accumulation":
        base = default_block_sizes(128, 128)
        fast = dataclasses.replace(base, fast_accumulation=True)
        variants = []
        for causal in (False, True):
            variants += [("default", causal, base, True), ("fast", causal, fast, True),
                         ("promote32", causal, fast, True)]
        imprecise = {"promote32": 32}
        res["rowsums"] = {name: fastacc_rowsums(imprecise.get(name), impl) for name in ("fast", "promote32")}
        print("rowsums", res["rowsums"], flush=True)
    res["timing"] = []
    reference_out = {}
    for name, causal, bs, with_bwd in variants:
        if time.time() - start > args.budget:
            res["timing"].append(dict(variant=name, causal=causal, error="skipped: time budget"))
            continue
        case = dataclasses.replace(main_case, causal=causal)
        sets = [case.arrays(seed=s, dtype=jnp.bfloat16) for s in (0, 1)]
        attn = lambda q, k, v, bs=bs, c=causal: dm_jax.attention(  # noqa: E731
            q, k, v, causal=c, implementation=impl, block_sizes=bs)
        row = dict(variant=name, causal=causal, block_sizes=dataclasses.asdict(bs))
        try:
            with fast_fp8_accumulation(bs.fast_accumulation, imprecise.get(name)):
                out = jax.jit(attn)(*sets[0][:3])
            key = causal if args.set == "accumulation" else (causal, bs.fast_accumulation)
            if key in reference_out:  # first variant of this (causal, fast) pair: the default
                ref = reference_out[key]
                row["max_rel_vs_first"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            else:
                reference_out[key] = out.astype(jnp.float32)
            steps = [("fwd", fwd_step(attn), 1.0)] + ([("fwdbwd", fwdbwd_step(attn), 3.5)] if with_bwd else [])
            for kind, step, mult in steps:
                iters, reps = (1, 1) if args.smoke else (8, 3)
                med, lo, hi = time_step(step, sets, iters, reps, bs.fast_accumulation, imprecise.get(name))
                row[f"{kind}_ms"] = med * 1e3
                row[f"{kind}_tflops"] = mult * case.flops_fwd / med / 1e12
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(json.dumps(row), flush=True)
        res["timing"].append(row)
    res["seconds"] = time.time() - start
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in res["timing"]:
        print(r["variant"], r["causal"], {k: round(v, 1) for k, v in r.items() if k.endswith(("_ms", "_tflops"))}, r.get("error", ""))


if __name__ == "__main__":
    main()
