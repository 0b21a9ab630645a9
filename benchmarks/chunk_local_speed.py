"""The chunk-local stage alone, XLA's against the Pallas kernels, timed on the GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/chunk_local_speed.py --out $OUT

At one GDN layer's shape (default gdn_gqa-569m: B 8, T 4096, H 8, K = V = 128, C 64, packed
documents of about 1,500 tokens): the forward (the state pass's six operands from q, k, v,
the log decays and beta) and forward + backward (jax.value_and_grad of a fixed random
linear function of the operands), for XLA's stages (`recurrent_chunked`'s chunk_prep, pair,
solve) and `dm_jax.nn.chunk_local_pallas`; then the Pallas backward's two kernels alone
(`pallas_kernels.chunk_local.backward`, pairs and solve, from random cotangents). Every
result is compared with XLA's at full f32 precision (Precision.HIGHEST): max abs
difference over max abs value, so no speed stands without its check. Inputs as the
mixers give them (`recurrence_speed.inputs`), fresh random; median of --reps runs of
--iters calls. Writes chunk_local_speed.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.recurrence_speed import SHAPES, inputs, median_seconds
from dm_jax.nn.chunk_local_pallas import pallas_chunk_local
from dm_jax.nn.recurrence import _chunk_local_xla
from pallas_kernels.chunk_local import backward as kernels_backward
from pallas_kernels.chunk_local.config import ChunkLocalConfig


def operands_fns(B, T, C, seg, delta_rule, config, precision=None):
    """{name: fn(q, k, v, g, b) -> the six operands} for XLA and Pallas."""
    N = T // C
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    carried = (seg.reshape(B, N, C) == prev[:, ::C][:, :, None]).reshape(B, T)

    def xla(q, k, v, g, b):
        with jax.default_matmul_precision(precision or "default"):
            return _chunk_local_xla(q, k, v, g, b, seg, prev, C, N, "blocks", delta_rule)

    def pallas(q, k, v, g, b):
        return pallas_chunk_local(
            q, k, v, g[..., 0], b, seg, carried, chunk_size=C, delta_rule=delta_rule, config=config
        )

    return {"xla": xla, "pallas": pallas}


def rel_diff(a, b) -> float:
    leaves = [(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in leaves)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shape", choices=tuple(SHAPES), default="569m")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=1500, help="tokens per packed document")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    s = SHAPES[args.shape]
    B, T, C = s.b, s.t, args.chunk
    x = inputs(s, seed=1)
    seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None] // args.doc_len, (B, T))
    seg = seg + jnp.arange(B, dtype=jnp.int32)[:, None] * 7 % args.doc_len  # rows differ
    config = ChunkLocalConfig()
    fns = operands_fns(B, T, C, seg, s.delta_rule, config)
    exact = operands_fns(B, T, C, seg, s.delta_rule, config, precision="highest")["xla"]
    weights = [
        jax.random.normal(jax.random.key(i), o.shape)
        for i, o in enumerate(jax.eval_shape(fns["xla"], *x))
        if o is not None
    ]

    def loss_of(fn):
        return lambda *a: sum(
            jnp.sum(o * w) for o, w in zip([o for o in fn(*a) if o is not None], weights)
        )

    want = jax.jit(exact)(*x)
    want_grads = jax.jit(jax.grad(loss_of(exact), argnums=range(5)))(*x)
    rows = []
    for name, fn in fns.items():
        fwd = jax.jit(fn)
        got, fwd_s = median_seconds(fwd, x, args.iters, args.reps)
        both = jax.jit(jax.value_and_grad(loss_of(fn), argnums=range(5)))
        (_, grads), both_s = median_seconds(both, x, args.iters, args.reps)
        rows.append(
            dict(
                form=name,
                fwd_ms=1e3 * fwd_s,
                fwdbwd_ms=1e3 * both_s,
                err_operands=rel_diff(
                    [o for o in got if o is not None], [o for o in want if o is not None]
                ),
                err_grads=rel_diff(grads, want_grads),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    # the backward's two kernels alone, from the forward's residuals and random cotangents
    N = T // C
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    carried = (seg.reshape(B, N, C) == prev[:, ::C][:, :, None]).astype(jnp.float32)
    q, k, v, g, b = x
    tok = lambda a: a.reshape(B, N, C, *a.shape[2:])
    from pallas_kernels.chunk_local.forward import forward

    fwd_args = (tok(q), tok(k), tok(v), tok(g[..., 0]), tok(b), seg.reshape(B, N, C), carried)
    interpret = jax.default_backend() != "gpu"
    kw = dict(delta_rule=s.delta_rule, config=config, interpret=interpret)
    _, Tinv = jax.jit(lambda *a: forward(*a, store_inverse=True, **kw))(*fwd_args)
    cts = [w for w in weights[:5]]
    cts = [cts[0], cts[1] if s.delta_rule else None] + cts[2 if s.delta_rule else 1 :][:3]
    bwd = jax.jit(lambda *a: kernels_backward.backward(*a, Tinv, cts, **kw))
    _, bwd_s = median_seconds(bwd, fwd_args, args.iters, args.reps)
    rows.append(dict(form="pallas backward kernels alone", fwdbwd_ms=1e3 * bwd_s))
    os.makedirs(args.out, exist_ok=True)
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, shape=args.shape,
                chunk=C, doc_len=args.doc_len, rows=rows)  # fmt: skip
    with open(os.path.join(args.out, "chunk_local_speed.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"{info['device']}, shape {args.shape}, C {C}")
    print("| form | fwd ms | fwd+bwd ms | rel err operands | rel err grads (vs f32 XLA) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        fmt = lambda key, spec: format(r[key], spec) if key in r else "-"
        print(f"| {r['form']} | {fmt('fwd_ms', '.3f')} | {fmt('fwdbwd_ms', '.3f')} | "
              f"{fmt('err_operands', '.1e')} | {fmt('err_grads', '.1e')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
