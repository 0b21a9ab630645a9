"""The chunked linear recurrence's state passes across chunks, timed on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/recurrence_speed.py --out $OUT

`dm_jax.nn.recurrence.recurrent_chunked` at one mixer's shape (--shape; default the GDN
layer of gdn_gqa-569m: B 8, T 4096, 8 heads, K = V = 128, delta rule, one decay per head),
for each chunk size of the shape and each state pass (--variants):
  sequential   the lax.scan over chunks (the default)
  pallas       one Pallas kernel per direction, the state on chip (default launch settings)
  associative  lax.associative_scan over the chunks' affine maps
  unroll4/16   the lax.scan with unroll 4 / 16
  pallas_w4    the pallas pass with 4 warps per program in both directions (default 8)
  pallas_v32   the pallas pass with V blocks of 32 (default 64) and 4 warps: twice the
               programs, two per SM
  pallas_ieee  the pallas pass with full-f32 dots (default tf32, as XLA's f32 matmuls)
  pallas_doubling / pallas_triangular   the pallas pass with the delta rule's triangular
               systems solved by `solve="doubling"` / `"triangular"` (default "blocks")
  pallas_chunk_outputs   the pallas pass writing o (and reading dO) in the chunk layout
               [N, B, H, C, V], transposed by XLA (default: token-major, no transpose)
  pallas_chunk_local   the pallas pass with the chunk-local stage (decays, A, the solve, P,
               qg, K_end) in one Pallas kernel per direction too (`chunk_local="pallas"`;
               default: XLA's stages); sequential_chunk_local: the same with the scan
The pallas pass refuses chunks over 128 (shared memory); those rows say "skipped".
Each is compiled (seconds recorded), run once, then timed: the median over --reps of
--iters back-to-back calls, forward alone (o and the final state) and forward + backward
(jax.value_and_grad wrt q, k, v, log_decay, beta of --loss: `sum`, sum(o), or
`gated_norm`, sum(RMSNorm(o) * W) over V with fixed W, as the mixers' gated output norm
reads o, so dO is a real tensor rather than a broadcast one). Every row also gives the max
abs difference of its o, final state and gradients from the first variant (sequential at the
shape's first chunk size, 64 for the GDN shapes), so no speed stands without its check.
Inputs: L2-normalized q (times K^-1/2) and k, Gaussian v, sigmoid beta, log decays
-A dt with A ~ U[1, 16] and dt log-uniform in [1e-3, 0.1] (the mixers' initial gates).
Variants past --budget seconds are skipped (rows say so). XLA_FLAGS is recorded: the
training profile that motivated this ran with CUDA command buffers off
(XLA_FLAGS=--xla_gpu_enable_command_buffer=). Writes recurrence_speed_<shape>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from dm_jax.nn.recurrence import recurrent_chunked
from pallas_kernels.chunk_local.config import MAX_CHUNK
from pallas_kernels.linear_recurrence.config import MAX_COMPILED_CHUNK, MIN_DOT, StatePassConfig


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    t: int
    h: int
    k: int
    v: int
    g: int  # decay width: 1 (per head) or k (per key channel, KDA)
    delta_rule: bool
    chunks: tuple


SHAPES = {
    "569m": Shape(8, 4096, 8, 128, 128, 1, True, (64, 128, 256)),  # gdn_gqa-569m's GDN layer
    "t8192": Shape(8, 8192, 8, 128, 128, 1, True, (64, 128, 256)),
    "kda": Shape(8, 4096, 8, 128, 128, 128, True, (32, 64)),  # [C, C, K] pair decays: C <= 64
    "mamba2": Shape(8, 4096, 32, 128, 64, 1, False, (64, 128, 256)),  # mamba2_gqa-569m
    "tiny": Shape(1, 40, 2, 8, 8, 1, True, (8, 16)),  # CPU check of the script
    "tiny64": Shape(1, 64, 2, 16, 16, 1, True, (16,)),  # CPU check: sizes the kernels take
}
VARIANTS = {  # name: (state_pass, scan_unroll, pallas launch settings (None: the defaults),
    # the delta rule's triangular solve, how the chunks' own operands are formed)
    "sequential": ("sequential", 1, None, "blocks", "xla"),
    "pallas": ("pallas", 1, None, "blocks", "xla"),
    "associative": ("associative", 1, None, "blocks", "xla"),
    "unroll4": ("sequential", 4, None, "blocks", "xla"),
    "unroll16": ("sequential", 16, None, "blocks", "xla"),
    "pallas_w4": ("pallas", 1, StatePassConfig(forward_warps=4, backward_warps=4), "blocks", "xla"),
    "pallas_v32": (
        "pallas",
        1,
        StatePassConfig(block_v=32, forward_warps=4, backward_warps=4),
        "blocks",
        "xla",
    ),
    "pallas_ieee": ("pallas", 1, StatePassConfig(dot_precision="ieee"), "blocks", "xla"),
    "pallas_doubling": ("pallas", 1, None, "doubling", "xla"),
    "pallas_triangular": ("pallas", 1, None, "triangular", "xla"),
    "pallas_chunk_outputs": (
        "pallas",
        1,
        StatePassConfig(token_major_outputs=False),
        "blocks",
        "xla",
    ),
    "pallas_chunk_local": ("pallas", 1, None, "blocks", "pallas"),
    "sequential_chunk_local": ("sequential", 1, None, "blocks", "pallas"),
}
LOSSES = ("sum", "gated_norm")
ARGNAMES = ("q", "k", "v", "log_decay", "beta")


def inputs(s: Shape, seed: int = 0):
    """(q, k, v, log_decay, beta) in float32, as the mixers feed the recurrence."""
    ks = jax.random.split(jax.random.key(seed), 6)
    norm = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    q = norm(jax.random.normal(ks[0], (s.b, s.t, s.h, s.k))) * s.k**-0.5
    k = norm(jax.random.normal(ks[1], (s.b, s.t, s.h, s.k)))
    v = jax.random.normal(ks[2], (s.b, s.t, s.h, s.v))
    A = jax.random.uniform(ks[3], (s.h, s.g), minval=1.0, maxval=16.0)
    log_dt = jax.random.uniform(ks[4], (s.b, s.t, s.h, s.g), minval=jnp.log(1e-3), maxval=-2.3)
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (s.b, s.t, s.h)))
    return q, k, v, -A * jnp.exp(log_dt), beta


def compiled_and_seconds(fn, args):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def median_seconds(compiled, args, iters: int, reps: int):
    """(first output, median seconds per call): one warm-up call, then `reps` runs of
    `iters` calls dispatched back to back and waited for at the end."""
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            last = compiled(*args)
        jax.block_until_ready(last)
        times.append((time.perf_counter() - t0) / iters)
    return out, statistics.median(times)


def max_abs_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def gated_norm_loss(o_BTHV):
    """sum(RMSNorm(o) * W) over V, W fixed: what the mixers' gated output norm makes of o."""
    w = jnp.cos(jnp.arange(o_BTHV.shape[-1], dtype=jnp.float32))
    return jnp.sum(o_BTHV * jax.lax.rsqrt(jnp.mean(o_BTHV * o_BTHV, -1, keepdims=True) + 1e-6) * w)


def variant_fns(
    s: Shape,
    chunk: int,
    state_pass: str,
    unroll: int,
    pallas_config,
    solve,
    chunk_local="xla",
    loss="sum",
):
    """(forward, forward + backward) of one variant: `recurrent_chunked` -> (o, final S), and
    jax.value_and_grad of the named loss of o (`LOSSES`) wrt every input."""
    kw = dict(delta_rule=s.delta_rule, chunk_size=chunk, state_pass=state_pass)
    kw.update(scan_unroll=unroll, pallas_config=pallas_config, solve=solve, chunk_local=chunk_local)
    fwd = lambda *a: recurrent_chunked(*a, **kw)
    of_o = jnp.sum if loss == "sum" else gated_norm_loss
    return fwd, jax.value_and_grad(lambda *a: of_o(fwd(*a)[0]), argnums=tuple(range(len(ARGNAMES))))


def bench_variant(
    s: Shape,
    chunk: int,
    state_pass: str,
    unroll: int,
    pallas_config,
    solve,
    chunk_local,
    args,
    iters,
    reps,
    loss="sum",
):
    """Row of one variant plus its (forward outputs, gradients) for the checks."""
    fwd, fwdbwd = variant_fns(s, chunk, state_pass, unroll, pallas_config, solve, chunk_local, loss)
    fwd_c, fwd_compile = compiled_and_seconds(fwd, args)
    out, fwd_s = median_seconds(fwd_c, args, iters, reps)
    del fwd_c
    bwd_c, bwd_compile = compiled_and_seconds(fwdbwd, args)
    (_, grads), bwd_s = median_seconds(bwd_c, args, iters, reps)
    row = dict(
        fwd_ms=1e3 * fwd_s,
        fwdbwd_ms=1e3 * bwd_s,
        compile_s=fwd_compile + bwd_compile,
        max_abs_o=float(jnp.max(jnp.abs(out[0]))),
        max_abs_grad=max(float(jnp.max(jnp.abs(g))) for g in grads),
    )
    return row, (out, grads)


def table(rows, ref_name: str) -> str:
    lines = [
        f"| C | state pass | fwd ms | fwd+bwd ms | compile s | max abs diff vs {ref_name}: "
        "o | final S | grads |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        head = f"| {r['chunk']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:80]} |")
            continue
        lines.append(
            f"{head} {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {r['compile_s']:.1f} | "
            f"{r['diff_o']:.1e} | {r['diff_state']:.1e} | {r['diff_grads']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shape", choices=tuple(SHAPES), default="569m")
    p.add_argument("--chunks", default="", help="comma-separated (default: the shape's)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {tuple(VARIANTS)}")
    p.add_argument("--loss", choices=LOSSES, default="sum", help="what fwd+bwd differentiates")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget", type=float, default=150.0, help="seconds; later variants skip")
    args = p.parse_args(argv)
    start = time.time()
    s = SHAPES[args.shape]
    chunks = [int(c) for c in args.chunks.split(",") if c] or list(s.chunks)
    names = [n for n in args.variants.split(",") if n]
    if not names or set(names) - set(VARIANTS):
        p.error(f"--variants: choose from {tuple(VARIANTS)}, got {args.variants!r}")
    print("jax", jax.__version__, jax.devices(), flush=True)
    x = inputs(s)
    ref, ref_name, rows = None, f"{names[0]} C={chunks[0]}", []
    for chunk in chunks:
        for name in names:
            row = dict(chunk=chunk, variant=name)
            if ref is not None and time.time() > start + args.budget:
                rows.append(dict(row, error="skipped: time budget"))
                continue
            compiled = jax.default_backend() == "gpu"
            if VARIANTS[name][0] == "pallas" and compiled and chunk > MAX_COMPILED_CHUNK:
                rows.append(
                    dict(row, error=f"skipped: pallas pass needs C <= {MAX_COMPILED_CHUNK}")
                )
                continue
            if VARIANTS[name][4] == "pallas" and not (MIN_DOT <= chunk <= MAX_CHUNK and s.g == 1):
                why = f"skipped: chunk-local kernels need {MIN_DOT} <= C <= {MAX_CHUNK}, G = 1"
                rows.append(dict(row, error=why))
                continue
            try:
                result, outputs = bench_variant(
                    s, chunk, *VARIANTS[name], x, args.iters, args.reps, args.loss
                )
                row.update(result)
                ref = outputs if ref is None else ref
                (o, S), grads = outputs
                row.update(
                    diff_o=max_abs_diff(o, ref[0][0]),
                    diff_state=max_abs_diff(S, ref[0][1]),
                    diff_grads=max_abs_diff(grads, ref[1]),
                )
                del outputs, o, S, grads
            except Exception as e:
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    info = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        shape=dict(dataclasses.asdict(s), name=args.shape),
        reference=ref_name,
        loss=args.loss,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        rows=rows,
        seconds=time.time() - start,
        argv=sys.argv,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"recurrence_speed_{args.shape}.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"shape {args.shape}: {s}")
    print(table(rows, ref_name))
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
