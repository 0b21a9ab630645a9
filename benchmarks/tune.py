"""GPU probes for the kernel levers: FP8 accumulation modes, block sizes per head dim.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tune.py --set accumulation --out $OUT

Sets (``--set``):
* ``accumulation``: forward and forward+backward time of the FP8 matched kernels in each
  accumulation mode (fp8_accumulation.py), causal and not, at the main benchmark shape;
  then the accuracy study versus T (:func:`accuracy_vs_t`).
* ``blocks``: block sizes, warps and stages at head dim 128 (plus the device-cast check).
* ``heads``: the same for head dims 64, 256 and 192/128 (tiles per head dim: tiles.py and
  triton/config.py).
Timing as benchmarks/attention.py. Writes tune_<set>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import dm_jax
from benchmarks.attention import timing
from benchmarks.correctness import f32_out_and_grads, fro_rel, row_ratio
from dm_jax import backends, numerics
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES, Case
from pallas_kernels.fp8_attention.tiles import NumericsTiles, default_tiles
from pallas_kernels.fp8_attention.triton.config import (
    FP8_ACCUMULATION_MODES,
    TritonConfig,
    default_config,
)

MODES = FP8_ACCUMULATION_MODES


class Variant(NamedTuple):
    """One timed setting: the tiles (numerics) and the Triton launch settings."""

    tiles: NumericsTiles
    config: TritonConfig

    @classmethod
    def default(cls, dqk, dv, **config):
        return cls(default_tiles(dqk, dv), dataclasses.replace(default_config(dqk, dv), **config))


def cast_check():
    """XLA's f32 -> E4M3 cast on the device against ml_dtypes' round-to-nearest-even."""
    x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32) * 50.0
    scale = np.float32(2.0)
    got = np.asarray(jax.jit(lambda x: numerics.quantize(x, scale))(x)).view(np.uint8)
    want = np.clip(x * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return dict(values=int(x.size), differing=int(np.sum(got != want)))


def accuracy_vs_t(ts, implementation="triton", heads=8):
    """Per T and accumulation mode (causal, FP8 matched, head dim 128, unit-normal inputs):
    relative Frobenius error of out, dQ, dK, dV against f32 attention ("hp_*") and against
    the precise mode's kernels ("vs_precise_*": the accumulation's own error, with the FP8
    casts equal), and the matched pre-cast dS row sums |sum_j dS_ij| / sum_j |dS_ij|."""
    rows = []
    kern = backends.get(implementation)
    for t in ts:
        case = Case(f"T{t}", 1, t, t, heads, heads, 128, 128, causal=True)
        q, k, v, do = case.arrays(seed=3)
        hp = f32_out_and_grads(q, k, v, do, causal=True)
        precise = None
        for mode in MODES:
            var = Variant.default(128, 128, fp8_accumulation=mode)
            spec = AttentionSpec(True, "matched", "fp8", 128**-0.5, var.tiles)
            kw = dict(spec=spec, config=var.config)
            got = jax.jit(
                lambda q, k, v, do, kw=kw: (
                    lambda o, lse: (
                        o,
                        kern.backward(q, k, v, o, lse, do, None, None, with_stats=True, **kw),
                    )
                )(*kern.forward(q, k, v, None, None, **kw))
            )(q, k, v, do)
            out, g = got
            fields = (out, g.dq, g.dk, g.dv)
            row = dict(t=t, mode=mode)
            for name, a, b in zip(("out", "dq", "dk", "dv"), fields, hp):
                row[f"hp_{name}"] = fro_rel(a, b)
            if mode == "precise":
                precise = fields
            else:
                for name, a, b in zip(("out", "dq", "dk", "dv"), fields, precise):
                    row[f"vs_precise_{name}"] = fro_rel(a, b)
            row["pre_max"], row["pre_median"] = row_ratio(g.ds_rowsum_pre, g.ds_abssum_pre)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _head_class(dqk, dv):
    widest = max(dqk, dv)
    return 64 if widest <= 64 else 128 if widest <= 128 else 256


def block_variants(dqk, dv):
    """(name, Variant) to time for one head dim: the default first."""
    base = Variant.default(dqk, dv)
    fwd = {  # (block_q, block_k, warps, stages)
        64: [
            (64, 64, 4, 3),
            (128, 64, 4, 2),
            (128, 64, 4, 3),
            (128, 64, 8, 3),
            (64, 128, 4, 3),
            (128, 128, 8, 3),
            (64, 32, 4, 3),
            (64, 64, 4, 4),
        ],
        128: [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 4),
            (128, 128, 8, 3),
            (64, 128, 4, 3),
            (64, 64, 4, 3),
            (128, 32, 8, 3),
            (128, 64, 4, 3),
        ],
        256: [
            (64, 64, 8, 2),
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (64, 32, 4, 3),
            (64, 32, 8, 2),
            (64, 64, 8, 3),
            (32, 64, 4, 2),
            (64, 16, 4, 3),
        ],
    }[_head_class(dqk, dv)]
    bwd = {  # (bwd_block_q, bwd_block_k, warps, stages)
        64: [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (64, 32, 4, 2),
            (32, 64, 4, 2),
            (64, 128, 8, 2),
        ],
        128: [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (64, 32, 4, 2),
            (32, 64, 4, 2),
            (64, 64, 8, 2),
        ],
        256: [
            (64, 32, 8, 2),
            (32, 32, 4, 2),
            (32, 64, 4, 2),
            (64, 32, 4, 2),
            (32, 32, 4, 3),
            (64, 64, 8, 2),
        ],
    }[_head_class(dqk, dv)]
    out = [("default", base)]
    for bq, bk, w, st in fwd:
        out.append(
            (
                f"fwd_q{bq}_k{bk}_w{w}_s{st}",
                Variant(
                    dataclasses.replace(base.tiles, block_q=bq, block_k=bk),
                    dataclasses.replace(base.config, num_warps=w, num_stages=st),
                ),
            )
        )
    for bq, bk, w, st in bwd:
        out.append(
            (
                f"bwd_q{bq}_k{bk}_w{w}_s{st}",
                Variant(
                    dataclasses.replace(base.tiles, bwd_block_q=bq, bwd_block_k=bk),
                    dataclasses.replace(base.config, bwd_num_warps=w, bwd_num_stages=st),
                ),
            )
        )
    return out


def time_variant(case, name, var, with_fwd, with_bwd, impl, smoke):
    """Timing row of one Variant on one case (FP8 matched)."""
    sets = [case.arrays(seed=s, dtype=jnp.bfloat16) for s in (0, 1)]
    attn = lambda q, k, v: dm_jax.attention(  # noqa: E731
        q, k, v, causal=case.causal, implementation=impl, tiles=var.tiles, config=var.config
    )
    row = dict(
        case=case.name,
        variant=name,
        causal=case.causal,
        tiles=dataclasses.asdict(var.tiles),
        config=dataclasses.asdict(var.config),
    )
    kinds = ("fwd",) * with_fwd + ("fwdbwd",) * with_bwd
    row.update(timing(attn, case, sets, *((1, 1) if smoke else (8, 3)), kinds=kinds))
    return row


def plan(which, smoke, accumulation=None):
    """(case, name, Variant, time forward, time forward+backward) per timing row;
    ``accumulation`` sets the FP8 accumulation mode of the block-size variants."""
    shrink = (lambda c: c.shrunk()) if smoke else (lambda c: c)
    out = []
    if which == "accumulation":
        main = shrink(BENCH_SHAPES["main"])
        for causal in (False, True):
            for mode in MODES:
                var = Variant.default(128, 128, fp8_accumulation=mode)
                out.append((dataclasses.replace(main, causal=causal), mode, var, True, True))
        return out
    names = ["main"] if which == "blocks" else ["d64", "d256", "d192_128"]
    for shape in names:
        case = shrink(BENCH_SHAPES[shape])
        for name, var in block_variants(case.dqk, case.dv):
            if accumulation is not None:
                var = var._replace(
                    config=dataclasses.replace(var.config, fp8_accumulation=accumulation)
                )
            fwd_only, bwd_only = name.startswith("fwd_"), name.startswith("bwd_")
            out.append((case, name, var, not bwd_only, not fwd_only))
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget", type=float, default=300.0, help="seconds; later rows skipped")
    p.add_argument("--set", default="blocks", choices=("accumulation", "blocks", "heads"))
    p.add_argument(
        "--accumulation",
        default=None,
        choices=sorted(MODES),
        help="blocks / heads sets: FP8 accumulation mode of every variant (default: config's)",
    )
    p.add_argument(
        "--ts", default="1024,4096,16384", help="accumulation set: T of the accuracy study"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script: [1, 256, 2 heads] shapes, interpret mode",
    )
    args = p.parse_args(argv)
    impl = "triton_interpret" if args.smoke else "triton"
    start = time.time()
    res = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "set": args.set,
        "timing": [],
    }
    if args.set == "blocks":
        res["cast_check"] = cast_check()
        print("cast_check", res["cast_check"], flush=True)
    for case, name, var, with_fwd, with_bwd in plan(args.set, args.smoke, args.accumulation):
        if time.time() - start > args.budget:
            res["timing"].append(
                dict(case=case.name, variant=name, causal=case.causal, error="skipped: time budget")
            )
            continue
        try:
            row = time_variant(case, name, var, with_fwd, with_bwd, impl, args.smoke)
        except Exception as e:  # one failing variant must not lose the run
            traceback.print_exc()
            row = dict(
                case=case.name,
                variant=name,
                causal=case.causal,
                error=f"{type(e).__name__}: {str(e)[:500]}",
            )
        print(json.dumps(row), flush=True)
        res["timing"].append(row)
    if args.set == "accumulation":
        ts = [256] if args.smoke else [int(t) for t in args.ts.split(",")]
        try:
            res["accuracy_vs_t"] = accuracy_vs_t(ts, impl, heads=2 if args.smoke else 8)
        except Exception as e:
            traceback.print_exc()
            res["accuracy_vs_t"] = f"{type(e).__name__}: {str(e)[:500]}"
    res["seconds"] = time.time() - start
    with open(os.path.join(args.out, f"tune_{args.set}.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in res["timing"]:
        nums = {k: round(v, 2) for k, v in r.items() if k.endswith(("_ms", "_tflops"))}
        print(r["case"], r["variant"], "causal" if r["causal"] else "", nums, r.get("error", ""))
    for r in res.get("accuracy_vs_t", []) if isinstance(res.get("accuracy_vs_t"), list) else []:
        print({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
