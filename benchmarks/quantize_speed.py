"""The Mosaic backend's fused quantize kernel under several warps per program, on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/quantize_speed.py --warps 4,8 --out $OUT

At the main benchmark shape ([4, 4096, 16, 128], unit-normal bf16; ``--head-dim`` another
D, e.g. MLA's 192 in column pieces; ``--xla`` adds the XLA pass as a last row): the
forward's pre-pass (Q and K values, V's permuted K-major copy) and the backward's (Q, K, dO
with their K-major copies, V), each timed like benchmarks/passes.py, with the bytes it must move over its time
(GB/s: bf16 read once, every FP8 layout and the factors written once), and whether its
operands equal the first setting's bit for bit (they must: warps are a launch setting).
Writes quantize_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.passes import time_fn
from pallas_kernels.fp8_attention.arg_specs import BENCH_MAIN
from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel


def pre_passes(num_warps: int, interpret: bool, fused: bool = True):
    """{name: (fn of (q, k, v, do), the FP8 bytes it writes per element read)}: the fused
    kernel (``fused``) or the XLA pass."""
    quantize = quantize_kernel.quantizer(fused, interpret, num_warps)

    def forward(q, k, v, do):
        return quantize(q), quantize(k), quantize(v, values=False, k_major=True)

    def backward(q, k, v, do):
        return (
            quantize(q, k_major=True),
            quantize(k, k_major=True),
            quantize(v),
            quantize(do, k_major=True),
        )

    return {"forward_quantize": (forward, 3, 3), "backward_quantize": (backward, 4, 7)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warps", default="4,8", help="comma-separated warps per program")
    p.add_argument("--head-dim", type=int, default=None, help="instead of the main shape's")
    p.add_argument("--xla", action="store_true", help="also time the XLA pass (reference row)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="tiny shape in interpret mode (CPU)")
    args = p.parse_args(argv)
    case = BENCH_MAIN
    d = args.head_dim or case.dqk
    shape = (1, 256, 2, d) if args.smoke else (case.b, case.t, case.hq, d)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    arrays = [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys]
    elements = shape[0] * shape[1] * shape[2] * shape[3]
    rows, first = [], {}
    settings = [(int(w), True) for w in args.warps.split(",")] + ([(0, False)] if args.xla else [])
    for warps, fused in settings:
        for name, (fn, reads, fp8_writes) in pre_passes(warps, args.smoke, fused).items():
            out = jax.jit(fn)(*arrays)
            leaves = [jax.device_get(x) for x in jax.tree_util.tree_leaves(out)]
            if name not in first:
                first[name] = leaves
            same = all(
                a.shape == b.shape and bool((a.view("uint8") == b.view("uint8")).all())
                for a, b in zip(leaves, first[name])
            )
            iters, reps = (1, 1) if args.smoke else (args.iters, args.reps)
            seconds = time_fn(jax.jit(fn), arrays, iters, reps)
            moved = elements * (2 * reads + fp8_writes)
            rows.append(
                dict(
                    head_dim=d,
                    warps=warps if fused else "xla pass",
                    name=name,
                    ms=1e3 * seconds,
                    gb_per_s=moved / seconds / 1e9,
                    bitwise_same_as_first=same,
                )
            )
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quantize_speed.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1)
    print("| head dim | warps | pre-pass | ms | GB/s | bitwise as the first |")
    for r in rows:
        print(
            f"| {r['head_dim']} | {r['warps']} | {r['name']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
            f"{r['bitwise_same_as_first']} |"
        )
    return 0 if all(r["bitwise_same_as_first"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
