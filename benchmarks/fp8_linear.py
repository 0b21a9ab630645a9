"""FP8 linear layers: per-token against per-tensor scaling and bf16, speed and error.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/fp8_linear.py --out $OUT

Two measurements, each for the FFN variants `per_token` (FP8, the default), `per_tensor`
(FP8, the older rule) and `bf16`:
  * ffn: one SwiGLU block (d_model x hidden, B*T tokens), forward + backward (dx and every
    dW) under jit: median step time, and the relative Frobenius error of y, dx and dW against
    the same block in f32. Inputs are Gaussian with per-token gains 2^N(0, 2) (activations
    with outlier tokens), output gradients Gaussian.
  * train_step: a whole AdamW step of a preset model (FP8 attention arm `matched` with its
    FP8 projections, which follow the same scaling) : median step time, and the relative
    error of the loss and of the global gradient against the same parameters in f32 (f32
    compute, reference attention core, no FP8).
Before timing it checks causality: per-token FFN outputs of the first half of the tokens
do not change when the second half does (bit for bit), per-tensor ones do.
Writes fp8_linear.json and prints a markdown table (docs/numerics.md holds the results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dm_jax.models import HybridLM, preset
from dm_jax.nn.fp8 import SCALINGS
from dm_jax.nn.mlp import SwiGLU

F32 = jnp.float32
VARIANTS = (*SCALINGS, "bf16")
SIZES = {  # (d_model, hidden, batch, seq_len, model preset size)
    "h200": (2048, 5632, 8, 2048, "small"),
    "cpu": (512, 1536, 2, 512, "tiny"),  # the error columns of docs/numerics.md
    "tiny": (64, 128, 2, 64, "tiny"),
}


def _timed(step, args, reps: int) -> float:
    """Median seconds of the jitted ``step(*args)`` (compiled and warmed up first)."""
    compiled = jax.jit(step).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _worst_token(a, b) -> float:
    """Largest per-token relative error ||a_t - b_t|| / ||b_t||."""
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.max(jnp.linalg.norm(a - b, axis=-1) / jnp.linalg.norm(b, axis=-1)))


def _swiglu(variant: str, d: int, hidden: int, dtype=jnp.bfloat16) -> SwiGLU:
    fp8 = variant in SCALINGS
    scaling = variant if fp8 else "per_token"
    return SwiGLU(d, hidden, fp8=fp8, fp8_scaling=scaling, dtype=dtype, rngs=nnx.Rngs(0))


def _ffn_fwd_bwd(model: SwiGLU):
    graphdef, params = nnx.split(model)

    def step(params, x, dy):
        def out(params, x):
            return nnx.merge(graphdef, params)(x).astype(F32)

        y, vjp = jax.vjp(out, params, x)
        dparams, dx = vjp(dy)
        return y, dx, dparams

    return step, params


def ffn_rows(d, hidden, tokens, reps):
    kx, kg, kd = jax.random.split(jax.random.key(0), 3)
    gains = jnp.exp2(2.0 * jax.random.normal(kg, (tokens, 1)))
    x = (jax.random.normal(kx, (tokens, d)) * gains).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (tokens, d), F32)
    ref_step, ref_params = _ffn_fwd_bwd(_swiglu("bf16", d, hidden, dtype=F32))
    y_ref, dx_ref, dp_ref = jax.jit(ref_step)(ref_params, x.astype(F32), dy)
    rows, causal = [], {}
    for variant in VARIANTS:
        step, params = _ffn_fwd_bwd(_swiglu(variant, d, hidden))
        y, dx, dp = jax.jit(step)(params, x, dy)
        half = tokens // 2
        y2 = jax.jit(step)(params, x.at[half:].multiply(64.0), dy)[0]
        causal[variant] = bool(jnp.array_equal(y[:half], y2[:half]))
        err_w = max(_rel(a, b) for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_ref)))
        rows.append(
            dict(
                variant=variant,
                ms=1e3 * _timed(step, (params, x, dy), reps),
                err_y=_rel(y, y_ref),
                err_y_worst_token=_worst_token(y, y_ref),
                err_dx=_rel(dx, dx_ref),
                err_dw=err_w,
                first_half_unchanged=causal[variant],
            )
        )
    return rows, causal


def _train_step(cfg, batch):
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step, params, opt_state


def train_rows(size, batch_size, seq_len, reps):
    base = preset("gdn_gqa", size)
    batch = jax.random.randint(jax.random.key(1), (batch_size, seq_len + 1), 0, base.vocab_size)
    f32 = dataclasses.replace(
        base, attention="reference", compute_dtype="float32", ffn="bf16", attn_proj="bf16"
    )
    t0 = time.perf_counter()
    ref_step, ref_params, ref_opt = _train_step(f32, batch)
    _, _, loss_ref, g_ref = jax.jit(ref_step)(ref_params, ref_opt)
    print(f"train_step f32 reference: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for variant in VARIANTS:
        t0 = time.perf_counter()
        fp8 = variant in SCALINGS
        cfg = dataclasses.replace(
            base, ffn="fp8" if fp8 else "bf16", fp8_scaling=variant if fp8 else "per_token"
        )
        step, params, opt_state = _train_step(cfg, batch)
        _, _, loss, grads = jax.jit(step)(params, opt_state)
        gl, gl_ref = jax.tree.leaves(grads), jax.tree.leaves(g_ref)
        diff = sum(float(jnp.sum((a.astype(F32) - b) ** 2)) for a, b in zip(gl, gl_ref))
        norm = sum(float(jnp.sum(b**2)) for b in gl_ref)
        rows.append(
            dict(
                variant=variant,
                ms=1e3 * _timed(step, (params, opt_state), reps),
                err_loss=abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)),
                err_grad=(diff / norm) ** 0.5,
            )
        )
        print(f"train_step {variant}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def table(result) -> str:
    lines = [
        "| measurement | variant | step ms | err y / loss | worst token y | err dx / grad | err dW |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["ffn"]:
        lines.append(
            f"| ffn | {r['variant']} | {r['ms']:.3f} | {r['err_y']:.2e} "
            f"| {r['err_y_worst_token']:.2e} | {r['err_dx']:.2e} | {r['err_dw']:.2e} |"
        )
    for r in result["train_step"]:
        lines.append(
            f"| train_step | {r['variant']} | {r['ms']:.3f} | {r['err_loss']:.2e} | "
            f"| {r['err_grad']:.2e} | |"
        )
    return "\n".join(lines)


def _write(path: str, result: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for fp8_linear.json")
    p.add_argument("--size", choices=tuple(SIZES), default="h200")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--parts", default="ffn,train_step", help="comma-separated: ffn, train_step (default both)"
    )
    args = p.parse_args(argv)
    d, hidden, batch, seq_len, model_size = SIZES[args.size]
    parts = args.parts.split(",")
    ffn, causal = ffn_rows(d, hidden, batch * seq_len, args.reps) if "ffn" in parts else ([], {})
    ok = not causal or (causal["per_token"] and causal["bf16"] and not causal["per_tensor"])
    result = dict(
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        size=args.size,
        ffn_shape=dict(d_model=d, hidden=hidden, tokens=batch * seq_len),
        train_shape=dict(preset=f"gdn_gqa-{model_size}", batch=batch, seq_len=seq_len),
        causality_ok=ok,
        ffn=ffn,
        train_step=[],
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_linear.json")
    _write(path, result)  # the FFN rows survive a run stopped during the training steps
    print(table(result), flush=True)
    if "train_step" in parts:
        result["train_step"] = train_rows(model_size, batch, seq_len, args.reps)
    _write(path, result)
    print(table(result))
    print("causality check:", "not run" if not causal else "ok" if ok else f"FAILED {causal}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
