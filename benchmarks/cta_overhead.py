"""What a CTA of the Mosaic GPU kernels pays once, apart from its tiles, on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cta_overhead.py --out $OUT

Every shape has the same work (batch x T x S constant: [4, 4096, 16, 128]'s non-causal
pairs) cut into CTAs of different lengths: at T = 512 a forward CTA steps over 4 key tiles,
at T = 4096 over 32. Each pass runs on its own pre-quantized inputs (benchmarks/passes.py's
timing). Per pass, a least-squares fit of

    time = (CTAs / SMs) * (once + per_step * steps per CTA)

gives ``once``: the microseconds a CTA costs beyond its steps (operand and row loads, the
pipeline's fill, the epilogue's stores, the launch), the part a persistent grid would hide
under the previous tile's work. Writes cta_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.passes import time_fn
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import Case
from pallas_kernels.fp8_attention.mosaic_gpu import ops
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles

# pass name -> (rows of the CTA's outer loop, tokens per step of its inner loop)
PASSES = {
    "forward_kernel": (128, 128),
    "delta_matched_kernel": (128, 128),
    "dq_pass": (128, 64),
    "dkdv_pass": (128, 64),
}


def cta_counts(case: Case, outer: int, inner: int) -> tuple[int, int]:
    """(CTAs, inner steps per CTA) of a non-causal pass on a square shape without GQA
    (T = S, as many kv heads as query heads): one CTA per ``outer`` rows (queries, or keys
    in the key pass) of a head, stepping over the other side ``inner`` tokens at a time."""
    return case.b * case.hq * (case.t // outer), case.s // inner


def fit(rows, sms: int) -> dict:
    """Least squares of ms * 1e3 = waves * (once + per_step * steps) over ``rows``."""
    waves = np.array([r["ctas"] / sms for r in rows])
    a = np.stack([waves, waves * np.array([r["steps"] for r in rows])], axis=1)
    y = np.array([r["ms"] * 1e3 for r in rows])
    (once, per_step), *_ = np.linalg.lstsq(a, y, rcond=None)
    worst = float(np.max(np.abs(a @ np.array([once, per_step]) - y) / y))
    return dict(once_us=float(once), per_step_us=float(per_step), worst_rel_residual=worst)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--lengths", default="512,1024,2048,4096", help="T = S of each shape")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    names = args.passes.split(",")
    rows, start = [], time.time()
    for t in [int(x) for x in args.lengths.split(",")]:
        b = max(1, 4 * (4096 // t) ** 2)
        d = args.head_dim
        case = Case(f"T{t}", b, t, t, args.heads, args.heads, d, d)
        q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
        spec = AttentionSpec(False, "matched", "fp8", d**-0.5, default_tiles(d, d))
        try:
            plan = ops.passes(q, k, v, do, spec=spec, config=MosaicConfig(), interpret=False)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(t=t, b=b, error=str(e)[:300]))
            continue
        for name in names:
            fn, fargs, _ = plan[name]
            ctas, steps = cta_counts(case, *PASSES[name])
            row = dict(t=t, b=b, name=name, ctas=ctas, steps=steps)
            try:
                row["ms"] = time_fn(fn, fargs, args.iters, args.reps) * 1e3
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del q, k, v, do, plan
    fits = {}
    for name in names:
        good = [r for r in rows if r.get("name") == name and "ms" in r]
        if len(good) >= 2:
            fits[name] = fit(good, sms)
    with open(os.path.join(args.out, "cta_overhead.json"), "w") as f:
        info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, sms=sms)
        json.dump(dict(info, rows=rows, fits=fits, seconds=time.time() - start), f, indent=1)
    print("| pass | T | batch | CTAs | steps per CTA | ms |")
    for r in rows:
        print(
            f"| {r.get('name', '-')} | {r['t']} | {r['b']} | {r.get('ctas', '-')} | "
            f"{r.get('steps', '-')} | {r.get('ms', float('nan')):.3f} | {r.get('error', '')[:60]}"
        )
    print("| pass | us once per CTA | us per step | worst residual |")
    for name, f in fits.items():
        print(
            f"| {name} | {f['once_us']:.2f} | {f['per_step_us']:.3f} | "
            f"{f['worst_rel_residual']:.1%} |"
        )


if __name__ == "__main__":
    main()
