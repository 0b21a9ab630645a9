"""Masked pairs contribute nothing, NaN included: each GPU backend against the emulation.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/nan_masking.py --out $OUT

Causal attention with one NaN placed in Q, K, V or dO at token 3 (head 0): for every
backend, whether the outputs and gradients are NaN exactly where the emulation's are (the
queries that see the bad token, and what they touch), whether tokens 0-2 stay finite, and
the relative error of the finite entries against the emulation. Writes nan_masking.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import dm_jax

FIELDS = ("out", "dq", "dk", "dv")


def outputs(implementation, q, k, v, do):
    def f(q, k, v):
        return dm_jax.attention(q, k, v, causal=True, implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--implementations", default="pallas,triton,mosaic")
    p.add_argument("--t", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    shape = (1, args.t, 4, args.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    clean = [jax.random.normal(key, shape, jnp.bfloat16) for key in keys]
    rows = []
    for where in ("q", "k", "v", "do"):
        q, k, v, do = clean
        bad = {"q": 0, "k": 1, "v": 2, "do": 3}[where]
        operands = list(clean)
        operands[bad] = operands[bad].at[0, 3, 0, 5].set(jnp.nan)
        want = jax.jit(lambda *a: outputs("reference", *a))(*operands)
        for impl in args.implementations.split(","):
            got = jax.jit(lambda *a, impl=impl: outputs(impl, *a))(*operands)
            row = dict(nan_in=where, implementation=impl)
            for name, a, r in zip(FIELDS, got, want):
                a, r = a.astype(jnp.float32), r.astype(jnp.float32)
                ok = ~jnp.isnan(r)
                row[f"{name}_same_nan"] = bool(jnp.all(jnp.isnan(a) == jnp.isnan(r)))
                diff = jnp.linalg.norm(jnp.where(ok, a - r, 0.0))
                row[f"{name}_err"] = float(diff / jnp.linalg.norm(jnp.where(ok, r, 0.0)))
            row["first3_finite"] = bool(jnp.isfinite(got[0][0, :3]).all())
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "nan_masking.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f)
    print("| NaN in | backend | tokens 0-2 finite | NaN pattern = emulation (out, dq, dk, dv) |")
    for r in rows:
        same = ", ".join(str(r[f"{n}_same_nan"]) for n in FIELDS)
        print(f"| {r['nan_in']} | {r['implementation']} | {r['first3_finite']} | {same} |")


if __name__ == "__main__":
    main()
