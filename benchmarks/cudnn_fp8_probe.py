"""Probe of cuDNN's FP8 attention backward through JAX, and check of our adapter.

Runs on a GPU; writes cudnn_fp8_probe.json under --out.

1. Semantics (direct calls, unit-normal inputs that fit E4M3 unscaled): for several
   scale_dP values, with every gradient scale 1, the reported amax values and gradient
   errors; then, with dS in range, gradient scales 16 to see which outputs apply them.
2. `dm_jax.baselines.cudnn_fp8_attention` (three-pass current scaling) against f32
   attention and its VJP, on unit inputs and on inputs far from unit range, causal and
   not, next to our FP8 kernels on the same inputs (FP8-level errors are about 0.05-0.07).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cudnn_fp8_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import dm_jax
from dm_jax.reference import mha_reference

F32 = jnp.float32


def rel(a, b):
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def _unit_problem(causal, shape):
    """(backward, ref, base) for unit-normal FP8 q, k, v and dO: the jitted cuDNN FP8
    backward as a function of its params, the f32 reference gradients on the same FP8
    values, and base params (every factor 1 except P's scale, 256)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from dm_jax.baselines import fp8_backward

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q8, k8, v8, do8 = (jax.random.normal(kk, shape, F32).astype(jnp.float8_e4m3fn) for kk in ks)
    ref = jax.vjp(
        lambda q, k, v: mha_reference(q, k, v, causal=causal),
        *(x.astype(F32) for x in (q8, k8, v8)),
    )[1](do8.astype(F32))
    one = jnp.ones((1, 1, 1, 1), F32)
    base = {name: one for name in fa.fp8_params_keys}
    base["scale_s"], base["descale_s"] = one * 256.0, one / 256.0
    run = jax.jit(lambda p: fp8_backward((q8, k8, v8), p, do8, shape[-1] ** -0.5, causal))
    return run, ref, base


def semantics(causal, shape=(2, 1024, 4, 128)):
    """Direct cuDNN calls on FP8 inputs with known scales (section 1)."""
    backward, ref, base = _unit_problem(causal, shape)
    one = jnp.ones((1, 1, 1, 1), F32)

    def run(s_dp, s_out):
        p = {
            **base,
            "scale_dP": one * s_dp,
            "descale_dP": one / s_dp,
            "scale_dQ": one * s_out,
            "scale_dK": one * s_out,
            "scale_dV": one * s_out,
        }
        g8 = backward(p)
        grads = [g.astype(F32) for g in g8[:3]]
        return dict(
            scale_dP=s_dp,
            scale_out=s_out,
            err_if_scaled={n: rel(g / s_out, r) for n, g, r in zip("qkv", grads, ref)},
            err_if_unscaled={n: rel(g, r) for n, g, r in zip("qkv", grads, ref)},
            max_g8=[float(jnp.max(jnp.abs(g))) for g in grads],
            max_true=[float(jnp.max(jnp.abs(r))) for r in ref],
            amax={k: float(v) for k, v in g8[3].items()},
        )

    rows = [run(s, 1.0) for s in (1.0, 2.0**8, 2.0**14)]
    amax_dp = rows[0]["amax"]["amax_dP"]
    s_good = float(dm_jax.numerics.pow2_scale(jnp.float32(amax_dp)))
    rows.append(run(s_good, 1.0))
    rows.append(run(s_good, 16.0))

    # Which key scales which tensor: one of scale_dQ/dK/dV carries the dS scale X (with
    # descale_dP = 1/X), the other two and scale_dP carry distinct small powers of two.
    slots = []
    names = ("scale_dQ", "scale_dK", "scale_dV")
    for ds_key in names:
        p = {**base, "scale_dP": one * 8.0, "descale_dP": one / s_good}
        small = iter((2.0, 4.0))
        for n in names:
            p[n] = one * (s_good if n == ds_key else next(small))
        g8 = backward(p)
        grads = [g.astype(F32) for g in g8[:3]]
        slots.append(
            dict(
                keys={n: float(p[n].reshape(())) for n in names + ("scale_dP",)},
                ratio_g8_to_true=[
                    float(jnp.max(jnp.abs(g)) / jnp.max(jnp.abs(r))) for g, r in zip(grads, ref)
                ],
                amax_over_true={
                    n: float(g8[3][f"amax_d{n.upper()}"] / jnp.max(jnp.abs(r)))
                    for n, r in zip("qkv", ref)
                },
            )
        )
    return dict(sweep=rows, slots=slots)


def sensitivity(causal, shape=(2, 1024, 4, 128)):
    """log2 change of every backward output when one scale key is multiplied by 4.

    Base: unit-normal FP8 inputs, every factor 1 except scale_s = 256 (descale_s = 1/256)
    and the dS scale candidate scale_dQ = 2^k (descale_dP = 2^-k) that keeps dS in range.
    Outputs: max |dq8|, |dk8|, |dv8| and the four amax reports. A row of small integers
    (multiples of 2, i.e. powers of 4) is how each output depends on that key."""
    run, ref, base = _unit_problem(causal, shape)
    one = jnp.ones((1, 1, 1, 1), F32)
    amax_dp = float(run(base)[3]["amax_dP"])
    k_ds = float(jnp.floor(jnp.log2(448.0 / amax_dp)))
    base["scale_dQ"], base["descale_dP"] = one * 2.0**k_ds, one * 2.0**-k_ds

    def logs(p):
        dq8, dk8, dv8, amax = run(p)
        vals = [jnp.max(jnp.abs(g.astype(F32))) for g in (dq8, dk8, dv8)]
        vals += [amax[n] for n in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")]
        return [float(jnp.log2(jnp.maximum(v, 1e-30))) for v in vals]

    b = logs(base)
    true = [float(jnp.log2(jnp.max(jnp.abs(r)))) for r in ref]
    out = {
        "outputs": ["max|dq8|", "max|dk8|", "max|dv8|", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"],
        "dS_scale_exponent": k_ds,
        "base_minus_true_log2": [round(x - t, 2) for x, t in zip(b[:3] + b[3:6], true * 2)],
        "base_log2": [round(x, 2) for x in b],
        "per_key": {},
    }
    keys = [
        "descale_q",
        "descale_k",
        "descale_v",
        "descale_o",
        "descale_dO",
        "descale_s",
        "descale_dP",
        "scale_s",
        "scale_dQ",
        "scale_dK",
        "scale_dV",
        "scale_dP",
    ]
    for key in keys:
        out["per_key"][key] = [
            round(x - y, 2) for x, y in zip(logs({**base, key: base[key] * 4.0}), b)
        ]
    return out


def adapter(causal, wild, shape=(2, 1024, 4, 128)):
    """Our three-pass adapter and our FP8 kernels against f32 attention (section 2)."""
    from dm_jax.baselines import cudnn_fp8_attention

    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v, do = (jax.random.normal(kk, shape, F32) for kk in ks)
    if wild:  # far from unit range; dO with a common sign so dV columns add up
        q, k, v = q * 4.0, k * 0.25, v * 20.0
        do = 1e-4 * (1.0 + 0.5 * do)
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: mha_reference(q, k, v, causal=causal), q, k, v)
    ref = ref_vjp(do)
    rec = {}
    arms = {
        "cudnn_fp8": lambda q, k, v: cudnn_fp8_attention(q, k, v, causal=causal),
        "ours_fp8_matched": lambda q, k, v: dm_jax.attention(q, k, v, causal=causal),
    }
    for name, fn in arms.items():
        try:

            def step(q, k, v, do, fn=fn):
                out, vjp = jax.vjp(fn, q, k, v)
                return (out,) + vjp(do)

            got = jax.jit(step)(q, k, v, do)
            rec[name] = {
                n: rel(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), got, (ref_out,) + ref)
            }
            rec[name]["finite"] = bool(all(jnp.all(jnp.isfinite(g)) for g in got))
        except Exception as e:  # noqa: BLE001 - report and continue
            rec[name] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--semantics-only", action="store_true", help="skip section 2")
    parser.add_argument("--adapter-only", action="store_true", help="skip section 1")
    parser.add_argument(
        "--sensitivity",
        action="store_true",
        help="section 1 as the log2 response of each output to each scale key",
    )
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    records = {"jax": jax.__version__, "semantics": {}, "adapter": {}}
    for causal in (False, True):
        tag = "causal" if causal else "non_causal"
        try:
            if args.sensitivity:
                records.setdefault("sensitivity", {})[tag] = sensitivity(causal)
                print(json.dumps(records["sensitivity"][tag], indent=0), flush=True)
            elif not args.adapter_only:
                records["semantics"][tag] = semantics(causal)
        except Exception as e:  # noqa: BLE001
            records["semantics"][tag] = f"{type(e).__name__}: {str(e)[:400]}"
        print(tag, json.dumps(records["semantics"].get(tag)), flush=True)
        for wild in () if args.semantics_only else (False, True):
            key = f"{tag}_{'wild' if wild else 'unit'}"
            records["adapter"][key] = adapter(causal, wild)
            print(key, json.dumps(records["adapter"][key]), flush=True)
    with open(os.path.join(args.out, "cudnn_fp8_probe.json"), "w") as f:
        json.dump(records, f, indent=1)
    print("| inputs | arm | out | dq | dk | dv |")
    for key, rec in records["adapter"].items():
        for arm, r in rec.items():
            if isinstance(r, dict):
                print(
                    f"| {key} | {arm} | {r['out']:.3f} | {r['dq']:.3f} | {r['dk']:.3f} | {r['dv']:.3f} |"
                )
            else:
                print(f"| {key} | {arm} | {r[:100]} |")


if __name__ == "__main__":
    main()
