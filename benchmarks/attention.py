"""Attention speed on the GPU: our FP8 kernels (three delta modes), our bf16 path, cuDNN
FP8, cuDNN bf16 and XLA, in one process.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/attention.py --out $OUT

Timing: each arm's jitted step runs ``iters`` times inside one jitted ``fori_loop`` (one
dispatch, so the measured wall time is device time), alternating between two input sets
(each [4, 4096, 16, 128] bf16 tensor is 64 MiB, above the 50 MB L2); every iteration
reads a value that depends on the previous one so nothing is hoisted. The loop also sums
each output once (a memory-bound pass, under 2% of a step). Warm-up run first, then the
median of ``reps`` runs. TFLOP/s: fwd = 2 B H T S (Dqk + Dv) (causal: half), fwd+bwd =
3.5 x fwd. Memory: XLA's compiled memory analysis of one step (temporaries + outputs).
Error: relative Frobenius error of the output and the gradients against f32 attention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import dm_jax
from benchmarks.correctness import f32_out_and_grads, fro_rel
from dm_jax.baselines import cudnn_bf16_attention
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES, Case
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles
from pallas_kernels.fp8_attention.triton.config import FP8_ACCUMULATION_MODES, default_config

F32 = jnp.float32


BACKWARD_VARIANTS = {  # arm suffix -> (MosaicConfig fields, NumericsTiles fields)
    "early_p": (dict(backward_early_p=True), {}),
    "ds_tile": ({}, dict(ds_scale="tile", bwd_block_k=64)),  # the default until 2026-12-04
    "early_p_ds_tile": (dict(backward_early_p=True), dict(ds_scale="tile", bwd_block_k=64)),
    # dS scale tiles of 64 x 64 with per-row scales (the default until 2026-12-07)
    "dq64": ({}, dict(bwd_block_k=64)),
    # dQ's dS^ scaled per query over 128 keys: the dQ pass steps 128 keys (dK's per-key
    # scales stay over 64 queries)
    "dq128": ({}, dict(bwd_block_k=128)),
    # the backward's register dots chained two in flight (bitwise the default)
    "chained": (dict(backward_chained_dots=True), {}),
    # the key pass's S^T (and dP^T) A operand from registers (bitwise the default)
    "kregs": (dict(backward_key_registers="k"), {}),
    "chained_kregs": (dict(backward_chained_dots=True, backward_key_registers="k"), {}),
}


def arms(case: Case, implementation="pallas"):
    """name -> attention fn (q, k, v) -> out. ``ours_*`` without a suffix use the default
    tiles and launch settings of the backend ``implementation`` picks; ``_precise`` /
    ``_promote32`` / ``_fast`` run the Triton backend in that FP8 accumulation mode
    (pallas_kernels/fp8_attention/triton/fp8_accumulation.py)."""
    import dataclasses

    interpret = implementation.endswith("_interpret")  # the CPU smoke test
    ids = case.segment_ids()  # packed documents (every arm sees them), or None

    def ours(delta, precision, accumulation=None, backend=implementation, config=None, tiles=None):
        if interpret and not backend.endswith("_interpret"):
            backend += "_interpret"
        if accumulation is not None:
            config = dataclasses.replace(
                default_config(case.dqk, case.dv), fp8_accumulation=accumulation
            )
        return lambda q, k, v: dm_jax.attention(
            q,
            k,
            v,
            causal=case.causal,
            delta=delta,
            precision=precision,
            segment_ids=ids,
            implementation=backend,
            config=config,
            tiles=tiles,
        )

    out = {
        "ours_fp8_matched": ours("matched", "fp8"),
        "ours_fp8_do_matched": ours("do_matched", "fp8"),
        "ours_fp8_stale": ours("stale", "fp8"),
        "ours_bf16_stale": ours("stale", "bf16"),
    }
    for mode in FP8_ACCUMULATION_MODES:
        out[f"ours_fp8_matched_{mode}"] = ours("matched", "fp8", mode, backend="triton")
        out[f"ours_fp8_stale_{mode}"] = ours("stale", "fp8", mode, backend="triton")
    for delta in ("matched", "stale"):  # each backend on its own, whatever "pallas" picks
        out[f"triton_fp8_{delta}"] = ours(delta, "fp8", backend="triton")
        # the Triton backward on 64 x 128 dS scale tiles (the tiles are backend-neutral) and
        # on 64 x 64 (the default until 2026-12-07)
        for suffix, keys in (("dq128", 128), ("dq64", 64)):
            tiles = dataclasses.replace(default_tiles(case.dqk, case.dv), bwd_block_k=keys)
            out[f"triton_fp8_{delta}_{suffix}"] = ours(delta, "fp8", backend="triton", tiles=tiles)
        out[f"mosaic_fp8_{delta}"] = ours(delta, "fp8", backend="mosaic")
        # dQ by TMA reduce-add from the dK/dV pass (no dQ pass; not bitwise reproducible)
        out[f"mosaic_fp8_{delta}_dq_key_pass"] = ours(
            delta, "fp8", backend="mosaic", config=MosaicConfig(backward_dq="key_pass")
        )
        # head dims over 128: a dQ and a dK/dV launch per 128 columns (the default until
        # 2026-12-02: one dQ, one dV and one dK launch)
        out[f"mosaic_fp8_{delta}_per_chunk"] = ours(
            delta,
            "fp8",
            backend="mosaic",
            config=MosaicConfig(backward_wide_launches="per_chunk"),
        )
        # causal: the query tiles in the grid's order (the default until 2026-12-02: the
        # tiles that see the most keys first)
        out[f"mosaic_fp8_{delta}_grid_order"] = ours(
            delta, "fp8", backend="mosaic", config=MosaicConfig(causal_order="grid")
        )
        # segment ids: every tile visited, and masked (the default until 2026-12-02: since
        # then only the tiles a CTA's documents reach, those wholly inside one unmasked)
        out[f"mosaic_fp8_{delta}_every_tile"] = ours(
            delta, "fp8", backend="mosaic", config=MosaicConfig(document_tiles=False)
        )
        # Q, K, V quantized by the forward and again by the backward (the default until
        # 2026-12-04: since then the forward makes the backward's calls, which XLA merges)
        out[f"mosaic_fp8_{delta}_separate_quantize"] = ours(
            delta, "fp8", backend="mosaic", config=MosaicConfig(shared_quantize=False)
        )
        # the backward forms P while its dP^ dot runs (MosaicConfig.backward_early_p), and
        # dS^ with one scale per tile (NumericsTiles.ds_scale="tile"), each and both
        for suffix, (fields, tile_fields) in BACKWARD_VARIANTS.items():
            tiles = dataclasses.replace(default_tiles(case.dqk, case.dv), **tile_fields)
            out[f"mosaic_fp8_{delta}_{suffix}"] = ours(
                delta, "fp8", backend="mosaic", config=MosaicConfig(**fields), tiles=tiles
            )
        # the Mosaic forward with the Triton backward passes
        out[f"mosaic_fwd_triton_bwd_fp8_{delta}"] = ours(
            delta, "fp8", backend="mosaic", config=MosaicConfig(mosaic_backward=False)
        )
    try:
        from dm_jax.baselines import cudnn_fp8_attention

        if case.dqk == case.dv == 128:
            out["cudnn_fp8"] = lambda q, k, v: cudnn_fp8_attention(q, k, v, causal=case.causal)
    except Exception as e:  # baseline module missing: record, keep going
        print("cudnn_fp8 arm unavailable:", e)
    out["cudnn_bf16"] = lambda q, k, v: cudnn_bf16(q, k, v, case.causal, ids)
    # documents as cuDNN's packed sequences (starts and lengths) instead of a dense mask
    most = None if ids is None else case.t // case.segment_len + 2  # documents per row
    out["cudnn_bf16_packed"] = lambda q, k, v: cudnn_bf16(q, k, v, case.causal, ids, most)
    if case.t <= 4096:  # XLA materializes the [B, H, T, S] logits
        out["xla_bf16"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=case.causal, implementation="xla"
        )
    return out


def cudnn_bf16(q, k, v, causal, ids=None, max_segments=None):
    """cuDNN bf16 attention; its JAX entry needs Dv == Dqk, so a narrower V (MLA: 192/128)
    is zero-padded to Dqk and the output cut back (its extra work is not counted).
    Documents (``ids``: the case's (q ids, kv ids)) reach cuDNN as a dense mask, or given
    ``max_segments`` (documents per row, at most) as its packed sequences
    (`dm_jax.baselines.packed_segments`)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, dqk - dv)])
    if ids is not None and max_segments:  # packed sequences take the self-attention ids
        ids = ids[0]
    out = cudnn_bf16_attention(q, k, v, causal=causal, segment_ids=ids, max_segments=max_segments)
    return out[..., :dv]


def fwd_step(attn):
    return lambda q, k, v, do: (attn(q, k, v),)


def fwdbwd_step(attn):
    def step(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return step


def time_step(step, sets, iters, reps):
    """(median, min, max) seconds per step (see the module docstring)."""

    def loop(sets):
        def body(_, carry):
            acc, qs = carry
            new_qs = []
            for q, (_, k, v, do) in zip(qs, sets):
                outs = step(q, k, v, do)
                acc = acc + sum(jnp.sum(o.astype(F32)) for o in outs)
                # depend on the previous iteration (acc * 0 is not folded for floats)
                new_qs.append(q.at[0, 0, 0, 0].add((acc * 0).astype(q.dtype)))
            return acc, tuple(new_qs)

        return jax.lax.fori_loop(0, iters, body, (jnp.zeros((), F32), tuple(s[0] for s in sets)))[0]

    return run_timed(loop, sets, iters * len(sets), reps)


# step kind -> (step from an attention fn, FLOPs as a multiple of the forward's)
STEPS = {"fwd": (fwd_step, 1.0), "fwdbwd": (fwdbwd_step, 3.5)}


def timing(attn, case: Case, sets, iters, reps, kinds=tuple(STEPS)):
    """{kind}_ms, {kind}_ms_range and {kind}_tflops of ``attn`` on ``case`` for each kind."""
    row = {}
    for kind in kinds:
        make_step, mult = STEPS[kind]
        med, lo, hi = time_step(make_step(attn), sets, iters, reps)
        row[f"{kind}_ms"] = med * 1e3
        row[f"{kind}_ms_range"] = [lo * 1e3, hi * 1e3]
        row[f"{kind}_tflops"] = mult * case.flops_fwd / med / 1e12
    return row


def run_timed(loop, arg, calls_per_run, reps):
    """(median, min, max) seconds per call of ``loop(arg)``, which makes ``calls_per_run``
    calls: compiled, one warm-up run, then ``reps`` timed runs."""
    compiled = jax.jit(loop).lower(arg).compile()
    compiled(arg).block_until_ready()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled(arg).block_until_ready()
        times.append((time.perf_counter() - t0) / calls_per_run)
    return statistics.median(times), min(times), max(times)


def memory_bytes(step, args):
    ma = jax.jit(step).lower(*args).compile().memory_analysis()
    return None if ma is None else int(ma.temp_size_in_bytes + ma.output_size_in_bytes)


def errors(attn, args, hp):
    got = jax.jit(lambda q, k, v, do: (attn(q, k, v),) + fwdbwd_step(attn)(q, k, v, do))(*args)
    return {n: fro_rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, hp)}


def bench_case(case: Case, iters, reps, budget_end, only=None, implementation="pallas"):
    sets = [case.arrays(seed=s, dtype=jnp.bfloat16) for s in (0, 1)]
    hp = f32_out_and_grads(*[x.astype(F32) for x in sets[0]], case.causal, case.segment_ids())
    rows = []
    available = arms(case, implementation)
    for name in [n for n in only if n in available] if only else list(available):
        attn = available[name]
        if time.time() > budget_end:
            rows.append(
                dict(case=case.name, causal=case.causal, arm=name, error="skipped: time budget")
            )
            continue
        row = dict(case=case.name, causal=case.causal, arm=name)
        try:
            row.update(timing(attn, case, sets, iters, reps))
            row["fwdbwd_mem_mib"] = (memory_bytes(fwdbwd_step(attn), sets[0]) or 0) / 2**20
            row["err"] = errors(attn, sets[0], hp)
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows):
    lines = [
        "| shape | arm | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | mem MiB | err out | err dq | err dk | err dv |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['case']}{' causal' if r['causal'] else ''} | {r['arm']} | {r['error'][:80]} |"
            )
            continue
        e = r["err"]
        lines.append(
            f"| {r['case']}{' causal' if r['causal'] else ''} | {r['arm']} | {r['fwd_tflops']:.0f} | "
            f"{r['fwdbwd_tflops']:.0f} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
            f"{r['fwdbwd_mem_mib']:.0f} | {e['out']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} |"
        )
    return "\n".join(lines)


def main(argv=None):
    import dataclasses

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget", type=float, default=240.0)
    p.add_argument("--arms", default="", help="comma-separated subset, run in this order")
    p.add_argument("--causal", default="both", choices=("both", "0", "1"))
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script: each shape shrunk to [1, 256, 2 heads], interpret mode",
    )
    p.add_argument(
        "--shapes",
        default="main",
        help=f"comma-separated, from {sorted(BENCH_SHAPES)} (fp8_attention/arg_specs.py)",
    )
    args = p.parse_args(argv)
    start = time.time()
    print("jax", jax.__version__, jax.devices(), flush=True)
    only = [a for a in args.arms.split(",") if a]  # run in this order
    known = set(arms(BENCH_SHAPES["main"]))
    if set(only) - known:
        p.error(f"--arms: unknown {sorted(set(only) - known)}; choose from {sorted(known)}")
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in BENCH_SHAPES]
    if unknown or not names:
        p.error(f"--shapes: unknown {unknown}; choose from {sorted(BENCH_SHAPES)}")
    rows = []
    for name in names:
        for causal in {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]:
            case = dataclasses.replace(BENCH_SHAPES[name], causal=causal)
            impl = "pallas"
            if args.smoke:
                case, impl = case.shrunk(), "triton_interpret"
            rows += bench_case(case, args.iters, args.reps, start + args.budget, only, impl)
    info = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        rows=rows,
        seconds=time.time() - start,
        argv=sys.argv,
    )
    with open(os.path.join(args.out, f"benchmarks{args.tag}.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
