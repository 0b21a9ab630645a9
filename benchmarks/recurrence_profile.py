"""Where the chunked linear recurrence's forward + backward spends its time, per stage.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/recurrence_profile.py --out $OUT

One mixer's shape (`recurrence_speed.SHAPES`, default the GDN layer of gdn_gqa-569m), one
chunk size, for each `--variants` name of `recurrence_speed.VARIANTS`: jax.value_and_grad
of sum(o) compiled, timed (median over --reps of --iters calls), then --steps calls traced
with the jax profiler. The device time of each executed operation is added up by the stage
that `recurrent_chunked`'s named scopes give it (chunk_prep, pair, solve, state_pass; other:
outside them; unnamed: operations the compiled text gives no op_name) and by direction
(backward operations carry `transpose` in their op_name).
Every variant's gradients are compared with the first variant's (max abs difference), so no
time stands without its check. Writes recurrence_profile_<shape>.json; prints a table last.
On the H200 (2026-12-02) the per-stage split held only part of the device time (1.1 of
5.3 ms, command buffers off): the fwd+bwd times are right, the split is not yet complete.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import jax

from benchmarks.recurrence_speed import (
    SHAPES,
    VARIANTS,
    inputs,
    max_abs_diff,
    median_seconds,
    variant_fns,
)
from train import trace_summary, xla_flags

STAGES = ("chunk_prep", "pair", "solve", "state_pass")


def stage_of(op_name: str) -> str:
    words = trace_summary.scope_words(op_name)
    return next((s for s in STAGES if s in words), "other")


def profile_variant(fwdbwd, args, iters: int, reps: int, steps: int) -> tuple[dict, object]:
    """(row, gradients): time per call and device ms per (stage, direction) per call."""
    compiled = jax.jit(fwdbwd).lower(*args).compile()
    (_, grads), seconds = median_seconds(compiled, args, iters, reps)
    names = trace_summary.op_names(compiled.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                last = compiled(*args)
            jax.block_until_ready(last)
        events = trace_summary.op_events(trace_summary.read_trace(trace_dir), "")
    ms = collections.Counter()
    top = collections.Counter()
    for e in events:
        dur = float(e.get("dur", 0.0)) * 1e-3 / steps
        op_name = names.get(e["args"]["hlo_op"])
        if op_name is None:  # an operation the compiled text gives no op_name: counted apart
            ms["unnamed"] += dur
            top[e["args"]["hlo_op"]] += dur
            continue
        direction = "bwd" if "transpose" in op_name else "fwd"
        ms[f"{stage_of(op_name)}/{direction}"] += dur
        top[op_name.split("/", 1)[-1]] += dur
    row = dict(
        fwdbwd_ms=1e3 * seconds,
        device_ms=sum(ms.values()),
        by_stage_ms=dict(sorted(ms.items())),
        top_ops_ms=dict(top.most_common(12)),
    )
    return row, grads


def table(rows: list[dict]) -> str:
    cols = [f"{s}/{d}" for s in STAGES + ("other",) for d in ("fwd", "bwd")] + ["unnamed"]
    lines = [
        "| variant | fwd+bwd ms | device ms | " + " | ".join(cols) + " | grads vs first |",
        "|" + " --- |" * (len(cols) + 4),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error'][:100]} |")
            continue
        cells = " | ".join(f"{r['by_stage_ms'].get(c, 0.0):.2f}" for c in cols)
        lines.append(
            f"| {r['variant']} | {r['fwdbwd_ms']:.2f} | {r['device_ms']:.2f} | {cells} | "
            f"{r['diff_grads']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="569m", choices=sorted(SHAPES))
    p.add_argument("--chunk", type=int, default=None, help="default: the shape's first")
    p.add_argument("--variants", default="pallas,pallas_doubling,pallas_triangular")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="profiled calls")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    # XLA runs runs of kernels as CUDA command buffers, which the trace shows as one event
    # without an operation name: off, before jax starts its backend (as train.profile_step)
    xla_flags.set_unless_given("xla_gpu_enable_command_buffer", "")
    names = [n for n in args.variants.split(",") if n]
    if not names or set(names) - set(VARIANTS):
        p.error(f"--variants: choose from {tuple(VARIANTS)}, got {args.variants!r}")
    s = SHAPES[args.shape]
    chunk = args.chunk or s.chunks[0]
    x = inputs(s)
    rows, first = [], None
    for name in names:
        print(f"{name} ...", flush=True)
        try:
            _, fwdbwd = variant_fns(s, chunk, *VARIANTS[name])
            row, grads = profile_variant(fwdbwd, x, args.iters, args.reps, args.steps)
            first = grads if first is None else first
            row["diff_grads"] = max_abs_diff(grads, first)
        except Exception as e:  # a variant that does not compile here: say so, go on
            row = dict(error=f"{type(e).__name__}: {e}")
        rows.append(dict(variant=name, chunk=chunk, **row))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    payload = dict(
        shape=args.shape,
        chunk=chunk,
        devices=str(jax.devices()),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        rows=rows,
    )
    with open(os.path.join(args.out, f"recurrence_profile_{args.shape}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
