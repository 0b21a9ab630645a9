"""Where one attention layer's forward + backward spends its GPU time, kernel by kernel:
each arm's jitted step (end to end from bf16, as `benchmarks/attention.py` builds it) runs
under jax's profiler, and the kernels on the GPU's streams are added up by kind.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/layer_kernels.py \\
        --shape h569m_t4096_docs --causal 1 --arms mosaic_fp8_matched,cudnn_bf16_packed --out $OUT

Kinds (`kind`, from the kernel's name): our forward, query passes (the matched-delta pass
and the dQ pass share a kernel; in launch order the delta pass comes first), key pass
(dK/dV), the quantize pre-passes (Triton kernels), cuDNN, and XLA's own kernels (fusions:
the bounds rows of document tiles, casts, reductions). Per arm: microseconds per step by
kind, the stream-busy time, and one step's launches in order. A benchmark, not a test:
it needs a GPU and jax's profiler.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.attention import arms, fwdbwd_step
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES
from train.trace_summary import read_trace

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("forward kernel", ("forward_mosaic",)),
    ("query passes (delta, dQ)", ("query_pass",)),
    ("key pass (dK, dV)", ("key_pass",)),
    ("quantize pre-passes", ("quantize",)),
    ("cuDNN", ("cudnn", "sm90_flash", "flash_fprop", "flash_bprop", "fmha")),
)


def kind(name: str) -> str:
    low = name.lower()
    for label, parts in KINDS:
        if any(p in low for p in parts):
            return label
    return "XLA kernels and copies"


def stream_events(trace_dir: str) -> list[dict]:
    """Kernels and copies on the GPU's streams, in launch order."""
    events = [e for e in read_trace(trace_dir) if e["thread"].startswith("Stream")]
    return sorted(events, key=lambda e: float(e["ts"]))


def profile_arm(step, args, steps: int) -> dict:
    """Per-step microseconds by kind, the streams' busy span per step and one step's
    launches (name, kind, us), from `steps` profiled calls after two warm-up calls."""
    run = jax.jit(step)
    for _ in range(2):
        jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(run(*args))
        events = stream_events(d)
    return breakdown(events, steps)


def breakdown(events: list[dict], steps: int) -> dict:
    """`profile_arm`'s summary of the stream events of `steps` identical steps (in launch
    order): microseconds per step by kind, and the last step's launches."""
    by_kind = collections.Counter()
    for e in events:
        by_kind[kind(e["name"])] += float(e.get("dur", 0.0)) / steps
    per_step = len(events) // steps if steps else 0
    last = events[-per_step:] if per_step else []
    launches = [
        dict(name=e["name"][:90], kind=kind(e["name"]), us=round(float(e.get("dur", 0.0)), 1))
        for e in last
    ]
    return dict(
        us_by_kind={k: round(v, 1) for k, v in by_kind.most_common()},
        kernel_us=round(sum(by_kind.values()), 1),
        launches_per_step=per_step,
        launches=launches,
    )


def table(rows: list[dict]) -> str:
    kinds = [k for k, _ in KINDS] + ["XLA kernels and copies"]
    head = "| kind, us per step | " + " | ".join(r["arm"] for r in rows) + " |"
    lines = [head, "| --- |" + " ---: |" * len(rows)]
    for k in kinds:
        vals = [r.get("us_by_kind", {}).get(k) for r in rows]
        if any(vals):
            lines.append(f"| {k} | " + " | ".join(f"{v:,.1f}" if v else "-" for v in vals) + " |")
    lines.append("| all kernels | " + " | ".join(f"{r.get('kernel_us', 0):,.1f}" for r in rows))
    lines[-1] += " |"
    lines.append(
        "| launches per step | " + " | ".join(str(r.get("launches_per_step")) for r in rows)
    )
    lines[-1] += " |"
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="h569m_t4096_docs", choices=sorted(BENCH_SHAPES))
    p.add_argument("--causal", default="1", choices=("0", "1"))
    p.add_argument("--arms", default="mosaic_fp8_matched,cudnn_bf16_packed")
    p.add_argument("--steps", type=int, default=3, help="profiled calls per arm")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    case = dataclasses.replace(BENCH_SHAPES[args.shape], causal=args.causal == "1")
    available = arms(case)
    names = [a for a in args.arms.split(",") if a]
    if not names or set(names) - set(available):
        p.error(f"--arms: unknown {sorted(set(names) - set(available))}; from {sorted(available)}")
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    rows = []
    for name in names:
        try:
            row = profile_arm(fwdbwd_step(available[name]), (q, k, v, do), args.steps)
        except Exception as e:  # record, go on with the next arm
            row = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(dict(arm=name, case=case.name, causal=case.causal, **row))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "launches"}), flush=True)
        with open(os.path.join(args.out, "layer_kernels.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, argv=sys.argv, rows=rows), f, indent=1)
    print(table([r for r in rows if "error" not in r]))
    for r in rows:
        for launch in r.get("launches", []):
            print(f"{r['arm']:>24}  {launch['us']:>9.1f} us  {launch['kind']:<26} {launch['name']}")


if __name__ == "__main__":
    main()
