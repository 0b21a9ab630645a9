"""Where the time goes: each pass of our attention timed on its own, on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/passes.py --out $OUT

Passes (main benchmark shape, non-causal unless --causal 1): what the backend's ``passes``
lists (dm_jax.backends; Triton: the quantize pre-passes of the forward and the backward, the
forward kernel, the matched-delta kernel, the stale row dot, the dQ pass and the dK/dV pass);
in FP8 (each accumulation mode of --modes) and bf16.
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

from benchmarks.attention import run_timed
from dm_jax import backends
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES
from pallas_kernels.fp8_attention.tiles import default_tiles

F32 = jnp.float32


def time_fn(fn, args, iters, reps):
    """Median seconds of fn(*args); every iteration perturbs (by 0) the first 16- or
    32-bit float leaf, so the loop cannot hoist the call, and reads the first and the last
    element of every output, so XLA cannot drop a kernel launch whose part of an output
    (a column chunk joined to others) nothing reads (it did: the second 128-column launch
    of a head dim 256 pass, 2026-12-02)."""
    loop, leaves = timing_loop(fn, args, iters)
    return run_timed(loop, leaves, iters, reps)[0]


def timing_loop(fn, args, iters):
    """(loop, leaves): ``loop(leaves)`` calls fn on args ``iters`` times (:func:`time_fn`)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    first = next(
        i
        for i, x in enumerate(leaves)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 2
    )

    def loop(leaves):
        def body(_, carry):
            acc, leaves = carry
            out = fn(*jax.tree_util.tree_unflatten(tree, leaves))
            acc = acc + sum(
                jnp.sum(o[..., :1, :1].astype(F32)) + jnp.sum(o[..., -1:, -1:].astype(F32))
                for o in jax.tree_util.tree_leaves(out)
            )
            leaves = list(leaves)
            x = leaves[first]
            leaves[first] = x + (acc * 0).astype(x.dtype)
            return acc, leaves

        return jax.lax.fori_loop(0, iters, body, (jnp.zeros((), F32), leaves))[0]

    return loop, leaves


def backward_setting(text: str) -> dict:
    """``--bwd`` entry "KEYS:WARPS:STAGES" (an empty part keeps the default) -> overrides:
    bwd_block_k (the dS tile's keys, a numerics choice) and the Triton backward's
    bwd_num_warps, bwd_num_stages."""
    parts = (text.split(":") + ["", "", ""])[:3]
    names = ("bwd_block_k", "bwd_num_warps", "bwd_num_stages")
    return {n: int(x) for n, x in zip(names, parts) if x}


def passes(case, precision, mode, implementation="triton", setting=None):
    """name -> Pass(fn, args, matmuls counted) of a backend for one precision; ``mode``: the
    Triton FP8 accumulation mode, "default" (the backend's default launch config) or, for
    the Mosaic backend, "xla_quantize" (the quantize pre-pass as XLA ops, not one kernel);
    ``setting``: :func:`backward_setting`'s overrides."""
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    backend = backends.get(implementation)
    config = backend.default_config(case.dqk, case.dv)
    tiles = default_tiles(case.dqk, case.dv)
    setting = dict(setting or {})
    if "bwd_block_k" in setting:
        tiles = dataclasses.replace(tiles, bwd_block_k=setting.pop("bwd_block_k"))
    config = dataclasses.replace(config, **setting)
    if mode == "xla_quantize":
        config = dataclasses.replace(config, fused_quantize=False)
    elif mode != "default":
        config = dataclasses.replace(config, fp8_accumulation=mode)
    spec = AttentionSpec(case.causal, "matched", precision, case.dqk**-0.5, tiles)
    return backend.passes(q, k, v, do, spec=spec, config=config)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=150.0)
    p.add_argument(
        "--modes",
        default="precise,promote32,fast",
        help="Triton FP8 accumulation modes to time (bf16 runs once, after them); "
        "'default' for other backends; 'xla_quantize' for Mosaic's XLA quantize pre-pass",
    )
    p.add_argument(
        "--implementation",
        default="triton",
        choices=("triton", "mosaic"),
        help="the backend whose passes are timed",
    )
    p.add_argument("--shape", default="main", choices=sorted(BENCH_SHAPES))
    p.add_argument(
        "--bwd",
        default="",
        help="comma-separated backward settings KEYS:WARPS:STAGES (dS tile keys, Triton "
        "backward warps and stages; an empty part keeps the default), each timed in FP8 "
        "after --modes with its first mode",
    )
    p.add_argument("--only", default="", help="comma-separated pass names to time (default all)")
    p.add_argument("--bf16", type=int, default=1, help="0: skip the bf16 run")
    p.add_argument("--smoke", action="store_true", help="tiny shape in interpret mode (CPU)")
    args = p.parse_args(argv)
    start = time.time()
    case = dataclasses.replace(BENCH_SHAPES[args.shape], causal=bool(args.causal))
    if args.smoke:
        case = case.shrunk()
    one_matmul = 2 * case.b * case.hq * case.t * case.s * case.dqk * (0.5 if case.causal else 1.0)
    rows = []
    modes = [m for m in args.modes.split(",") if m]
    runs = [("fp8", m, "") for m in modes]
    runs += [("fp8", modes[0], b) for b in args.bwd.split(",") if b]
    if args.bf16:
        runs.append(("bf16", "precise" if args.implementation == "triton" else "default", ""))
    only = [n for n in args.only.split(",") if n]
    impl = args.implementation + ("_interpret" if args.smoke else "")
    for precision, base_mode, bwd in runs:
        mode = f"{base_mode} bwd {bwd}" if bwd else base_mode
        try:
            plan = passes(case, precision, base_mode, impl, backward_setting(bwd))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(
                dict(precision=precision, mode=mode, error=f"{type(e).__name__}: {str(e)[:500]}")
            )
            continue
        for name, (fn, fargs, matmuls) in plan.items():
            if only and name not in only:
                continue
            if time.time() - start > args.budget:
                rows.append(
                    dict(precision=precision, mode=mode, name=name, error="skipped: time budget")
                )
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
    name = f"passes{'' if args.shape == 'main' else '_' + args.shape}"
    with open(os.path.join(args.out, f"{name}{'_causal' if case.causal else ''}.json"), "w") as f:
        json.dump(
            dict(
                jax=jax.__version__,
                device=jax.devices()[0].device_kind,
                shape=[case.b, case.t, case.hq, case.dqk],
                rows=rows,
                seconds=time.time() - start,
            ),
            f,
            indent=1,
        )
    print("| precision | pass | ms | TFLOP/s |")
    for r in rows:
        print(
            f"| {r['precision']} {r.get('mode', '')} | {r.get('name', '-')} | "
            f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} | {r.get('error', '')[:60]}"
        )


if __name__ == "__main__":
    main()
