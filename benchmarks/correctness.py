"""GPU correctness of the Pallas kernels at realistic sizes.

For each head dim, causal or not, and every delta mode: the kernels (implementation
"pallas", or any name of dm_jax.backends) against the blockwise emulation of the same numerics (dm_jax.reference, same
tiles) and against high-precision attention (mha_reference, f32), under a random dO;
plus the normalized pre-/post-cast dS row sums |sum_j dS_ij| / sum_j |dS_ij|.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/correctness.py --out $OUT

Prints a table and writes correctness.json (one record per case and mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax import lax

from dm_jax import backends, reference
from dm_jax.numerics import DELTA_MODES
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import Case, gpu_cases
from pallas_kernels.fp8_attention.tiles import default_tiles
from pallas_kernels.fp8_attention.triton.config import FP8_ACCUMULATION_MODES

FIELDS = ("out", "dq", "dk", "dv")


def max_rel(a, b):
    """max |a - b| / max |b| over finite entries (f32 on the device, one number back)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    fin = jnp.isfinite(b)
    err = jnp.max(jnp.where(fin, jnp.abs(a - b), 0.0))
    return float(err / jnp.maximum(jnp.max(jnp.where(fin, jnp.abs(b), 0.0)), 1e-30))


def fro_rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


LOGIT_BYTES = 8 << 30  # f32 logits one slice of the f32 reference may hold


def f32_out_and_grads(q, k, v, do, causal, segment_ids=None, logit_bytes=LOGIT_BYTES):
    """(out, dq, dk, dv) of f32 attention (``mha_reference``) and its VJP under ``do``.

    ``mha_reference`` holds whole [B, Hq, T, S] f32 logits (16 GiB at T=16384 and 16
    heads), so the kv heads (each with its query heads) run in slices of at most
    ``logit_bytes`` of logits, one after another; heads are independent, so nothing else
    changes."""

    def run(q, k, v, do):
        def f(q, k, v):
            return reference.mha_reference(q, k, v, causal=causal, segment_ids=segment_ids)

        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do)

    b, t, hq, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    per_kv_head = b * (hq // hkv) * t * s * 4
    per_slice = max(
        d
        for d in range(1, hkv + 1)
        if hkv % d == 0 and d * per_kv_head <= max(logit_bytes, per_kv_head)
    )
    n = hkv // per_slice
    if n == 1:
        return jax.jit(run)(q, k, v, do)

    def split(x):  # [B, L, H, D] -> [n, B, L, H / n, D]: slice i = kv heads of slice i
        return jnp.moveaxis(x.reshape(x.shape[:2] + (n, x.shape[2] // n, x.shape[3])), 2, 0)

    def join(x):
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (-1, x.shape[-1]))

    sliced = jax.jit(lambda *a: lax.map(lambda xs: run(*xs), tuple(map(split, a))))
    return tuple(join(x) for x in sliced(q, k, v, do))


def row_ratio(rowsum, abssum):
    r = jnp.abs(rowsum) / jnp.where(abssum == 0, 1.0, abssum)
    return float(jnp.max(r)), float(jnp.median(r))


def visible_keys(case: Case, chunk: int = 1024):
    """[B, T] int32: how many keys each query sees (causality, segments, lengths)."""
    ids = case.segment_ids()
    if ids is None:
        q_ids, kv_ids = (
            jnp.zeros((case.b, case.t), jnp.int32),
            jnp.zeros((case.b, case.s), jnp.int32),
        )
    else:
        q_ids, kv_ids = ids
    keys = jnp.arange(case.s)

    def count(start):  # queries [start, start + chunk)
        rows = start + jnp.arange(chunk)
        qi = lax.dynamic_slice_in_dim(jnp.pad(q_ids, ((0, 0), (0, chunk))), start, chunk, 1)
        seen = qi[:, :, None] == kv_ids[:, None, :]
        if case.causal:
            seen = seen & (keys[None, None, :] <= rows[None, :, None])
        return jnp.sum(seen, axis=-1, dtype=jnp.int32)

    starts = jnp.arange(0, case.t, chunk)
    counts = jax.jit(lambda st: lax.map(count, st))(starts)  # [n, B, chunk]
    return jnp.moveaxis(counts, 0, 1).reshape(case.b, -1)[:, : case.t]


def multi_key_max(rowsum, abssum, visible):
    """The largest |sum_j dS_ij| / sum_j |dS_ij| over rows that see two keys or more: a
    row that sees one key has a one-element dS row, whose ratio is 1 by construction."""
    r = jnp.abs(rowsum) / jnp.where(abssum == 0, 1.0, abssum)
    return float(jnp.max(jnp.where(visible[:, None, :] >= 2, r, 0.0)))


def backward_kernels(kern, q, v, spec, cfg) -> str:
    """The kernels that run the backward: the Mosaic backend's own passes or the Triton
    passes it hands the calls they do not take (records name them, so a row can never be
    read as the wrong backward's)."""
    if kern.name.startswith("mosaic"):
        from pallas_kernels.fp8_attention.mosaic_gpu import ops as mosaic_ops

        return mosaic_ops.backward_kernels(q, v, spec, cfg)
    return kern.name


def run_case(case: Case, modes, with_reference=True, implementation="pallas", overrides=None):
    """Records (one per delta mode) for one shape; ``overrides``: launch-config fields of the
    backend to change from its defaults (e.g. the Triton FP8 accumulation mode),
    ``tiles``: NumericsTiles other than the head dims' defaults, and ``dtype``: the inputs'
    dtype (float32 unless named; the f32 attention they are checked against upcasts them)."""
    overrides = dict(overrides or {})
    dtype = jnp.dtype(overrides.pop("dtype", jnp.float32))
    q, k, v, do = case.arrays(seed=0, dtype=dtype)
    ids = case.segment_ids()
    q_ids, kv_ids = ids if ids is not None else (None, None)
    tiles = overrides.pop("tiles", None) or default_tiles(case.dqk, case.dv)

    def spec(mode):
        return AttentionSpec(case.causal, mode, case.precision, case.dqk**-0.5, tiles)

    kern, cfg = backends.resolve(implementation, q, k, v, spec(modes[0]))
    cfg = dataclasses.replace(cfg, **overrides)
    ref = backends.get("reference")
    ref_cfg = ref.default_config(case.dqk, case.dv)
    fwd = jax.jit(
        lambda q, k, v, qi, ki, s: kern.forward(q, k, v, qi, ki, spec=s, config=cfg),
        static_argnums=5,
    )
    out, lse = fwd(q, k, v, q_ids, kv_ids, spec(modes[0]))

    hp = f32_out_and_grads(*(x.astype(jnp.float32) for x in (q, k, v, do)), case.causal, ids)
    if with_reference:
        r_out, r_lse = jax.jit(
            lambda q, k, v, qi, ki, s: ref.forward(q, k, v, qi, ki, spec=s, config=ref_cfg),
            static_argnums=5,
        )(q, k, v, q_ids, kv_ids, spec(modes[0]))
    records = []
    visible = visible_keys(case)
    for mode in modes:
        t0 = time.time()
        s = spec(mode)
        bwd = jax.jit(lambda *a, s=s: kern.backward(*a, spec=s, config=cfg, with_stats=True))
        g = bwd(q, k, v, out, lse, do, q_ids, kv_ids)
        rec = dict(
            case=case.name,
            b=case.b,
            t=case.t,
            hq=case.hq,
            hkv=case.hkv,
            dqk=case.dqk,
            dv=case.dv,
            causal=case.causal,
            segments=case.segment_len is not None,
            precision=case.precision,
            dtype=dtype.name,
            delta=mode,
            implementation=kern.name,
            backward=backward_kernels(kern, q, v, s, cfg),
            config=dataclasses.asdict(cfg),
        )
        for name, a, b in zip(FIELDS, (out, g.dq, g.dk, g.dv), hp):
            rec[f"hp_{name}"] = fro_rel(a, b)
        rec["pre_max"], rec["pre_median"] = row_ratio(g.ds_rowsum_pre, g.ds_abssum_pre)
        rec["pre_max_multikey"] = multi_key_max(g.ds_rowsum_pre, g.ds_abssum_pre, visible)
        rec["post_max"], rec["post_median"] = row_ratio(g.ds_rowsum_post, g.ds_abssum_post)
        rec["finite"] = bool(all(jnp.all(jnp.isfinite(x)) for x in (out, g.dq, g.dk, g.dv)))
        if with_reference:
            rg = jax.jit(lambda *a, s=s: ref.backward(*a, spec=s, config=ref_cfg))(
                q, k, v, out, lse, do, q_ids, kv_ids
            )
            rec["ref_out"] = max_rel(out, r_out)
            rec["fro_ref_out"] = fro_rel(out, r_out)
            for name in ("dq", "dk", "dv", "delta"):
                rec[f"ref_{name}"] = max_rel(getattr(g, name), getattr(rg, name))
                rec[f"fro_ref_{name}"] = fro_rel(getattr(g, name), getattr(rg, name))
            rec["ref_pre_max"], _ = row_ratio(rg.ds_rowsum_pre, rg.ds_abssum_pre)
        rec["seconds"] = round(time.time() - t0, 1)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def table(records):
    cols = [
        "case",
        "delta",
        "precision",
        "backward",
        "ref_out",
        "ref_dq",
        "ref_dk",
        "ref_dv",
        "ref_delta",
        "fro_ref_out",
        "fro_ref_dq",
        "fro_ref_dk",
        "fro_ref_dv",
        "hp_out",
        "hp_dq",
        "hp_dk",
        "hp_dv",
        "pre_max",
        "pre_max_multikey",
        "pre_median",
        "post_median",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in records:
        cells = []
        for c in cols:
            x = r.get(c, "-")
            cells.append(f"{x:.2e}" if isinstance(x, float) else str(x))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; later cases skipped")
    parser.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    parser.add_argument(
        "--implementation",
        default="pallas",
        choices=backends.IMPLEMENTATIONS,
        help="triton_interpret (or another interpret twin) on a CPU",
    )
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument(
        "--bwd-block-k",
        type=int,
        default=0,
        help="the dS scale tile's keys (NumericsTiles.bwd_block_k) of every case; 0: defaults",
    )
    args = parser.parse_args(argv)
    start = time.time()
    print("jax", jax.__version__, jax.devices(), flush=True)
    plan = []  # (case, delta modes, launch-config overrides or None for the defaults)
    if args.quick:
        smoke = Case("smoke", 1, 300, 300, 4, 2, 64, 64, causal=True, segment_len=100)
        plan.append((smoke, DELTA_MODES, None))
    else:
        # ragged lengths, GQA, segments: the out-of-bounds and mask paths on the GPU
        plan.append(
            (
                Case(
                    "T2000_d128_gqa_seg_causal",
                    2,
                    2000,
                    2000,
                    8,
                    2,
                    128,
                    128,
                    causal=True,
                    segment_len=700,
                ),
                DELTA_MODES,
                None,
            )
        )
        # the same ragged, packed GQA case through the wide head dims' launches
        for dqk, dv in ((256, 256), (192, 128)):
            name = f"T2000_d{dqk}_{dv}_gqa_seg_causal"
            wide = Case(name, 2, 2000, 2000, 8, 2, dqk, dv, causal=True, segment_len=700)
            wide_f32 = args.implementation.startswith("mosaic") and max(dqk, dv) > 192
            plan.append((wide, DELTA_MODES, dict(dtype=jnp.bfloat16) if wide_f32 else None))
        for causal in (False, True):
            for c in gpu_cases(4096, causal, "matched"):
                # the Mosaic forward's f32 output tile fits shared memory up to D=192
                wide_f32 = args.implementation.startswith("mosaic") and max(c.dqk, c.dv) > 192
                plan.append((c, DELTA_MODES, dict(dtype=jnp.bfloat16) if wide_f32 else None))
        bf16 = gpu_cases(4096, False, "matched", head_dims=((128, 128),), precision="bf16")[0]
        plan.append(
            (dataclasses.replace(bf16, name=bf16.name + "_bf16"), ("matched", "stale"), None)
        )
        for causal in (False, True):
            plan.append(
                (gpu_cases(8192, causal, "matched", head_dims=((128, 128),))[0], DELTA_MODES, None)
            )
        # the longest rows: Delta-Matching's row sums at T = 16384
        long_rows = gpu_cases(16384, True, "matched", head_dims=((128, 128),))[0]
        plan.append((long_rows, ("matched", "stale"), None))
        other = gpu_cases(4096, True, "matched", head_dims=((128, 128),))[0]
        for mode in FP8_ACCUMULATION_MODES:  # the default's row above repeats one
            plan.append(
                (
                    dataclasses.replace(other, name=f"{other.name}_{mode}"),
                    ("matched", "stale"),
                    dict(fp8_accumulation=mode),
                )
            )
    only = [n for n in args.only.split(",") if n]
    if only:
        plan = [p for p in plan if p[0].name in only]
    if args.bwd_block_k:  # the same cases on other dS scale tiles (a numerics change)
        plan = [
            (
                dataclasses.replace(case, name=f"{case.name}_bwdk{args.bwd_block_k}"),
                modes,
                dict(
                    overrides or {},
                    tiles=dataclasses.replace(
                        (overrides or {}).get("tiles") or default_tiles(case.dqk, case.dv),
                        bwd_block_k=args.bwd_block_k,
                    ),
                ),
            )
            for case, modes, overrides in plan
        ]
    records, failures = [], []
    for case, modes, overrides in plan:
        if time.time() - start > args.budget:
            failures.append(dict(case=case.name, error="skipped: time budget"))
            continue
        try:
            records += run_case(
                case, modes, implementation=args.implementation, overrides=overrides
            )
        except Exception as e:  # keep going: one lowering failure must not lose the run
            traceback.print_exc()
            failures.append(dict(case=case.name, error=f"{type(e).__name__}: {str(e)[:2000]}"))
    with open(os.path.join(args.out, "correctness.json"), "w") as f:
        json.dump(
            dict(
                jax=jax.__version__,
                device=str(jax.devices()[0]),
                records=records,
                failures=failures,
                seconds=time.time() - start,
            ),
            f,
            indent=1,
        )
    print(table(records))
    for fl in failures:
        print("FAILED", fl["case"], fl["error"][:300])
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
