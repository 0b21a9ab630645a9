"""Probe of cuDNN's FP8 attention backward through JAX: which scale convention it uses.

Runs on a GPU. Prints, for unit-normal inputs where every tensor fits E4M3 unscaled, the
gradient error of `dm_jax.baselines.cudnn_fp8_attention` and of direct cuDNN calls with
known output scales, plus the amax values cuDNN reports, so the adapter's recipe can be
checked against what the library really does. Writes JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from dm_jax.reference import mha_reference


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from dm_jax.baselines import cudnn_fp8_attention

    b, t, h, d = 2, 256, 4, 128
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.float32) for kk in ks)
    records = {}
    for causal in (False, True):
        ref_out, ref_vjp = jax.vjp(lambda q, k, v: mha_reference(q, k, v, causal=causal), q, k, v)
        ref = ref_vjp(do)
        rec = {}
        try:
            out, vjp = jax.vjp(lambda q, k, v: cudnn_fp8_attention(q, k, v, causal=causal, unverified_gradients=True), q, k, v)
            got = vjp(do)
            rec["adapter"] = {"out": rel(out, ref_out), **{n: rel(g, r) for n, g, r in zip("qkv", got, ref)}}
        except Exception as e:  # noqa: BLE001 - report and continue
            rec["adapter"] = repr(e)[:300]
        f8 = jnp.float8_e4m3fn
        q8, k8, v8, do8 = (x.astype(f8) for x in (q, k, v, do))
        for out_scale in (1.0, 4.0):
            one = jnp.ones((1, 1, 1, 1), jnp.float32)
            params = {name: one for name in fa.fp8_params_keys}
            params["scale_s"] = params["scale_s"] * 256.0
            params["descale_s"] = params["descale_s"] / 256.0
            for name in ("scale_dQ", "scale_dK", "scale_dV"):
                params[name] = params[name] * out_scale
            mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
            run = lambda q8, k8, v8, p: fa.dot_product_attention(
                q8, k8, v8, fp8_params=p, scale=d**-0.5, mask_type=mask, qkv_layout="BTNH", use_fp8=True)
            try:
                (o8, amax_s, amax_o), vjp = jax.vjp(run, q8, k8, v8, params)
                dq8, dk8, dv8, dparams = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
                ref8_out, ref8_vjp = jax.vjp(
                    lambda q, k, v: mha_reference(q, k, v, causal=causal),
                    *(x.astype(jnp.float32) for x in (q8, k8, v8)))
                ref8 = ref8_vjp(do8.astype(jnp.float32))
                rec[f"direct_scale{out_scale:g}"] = {
                    "out": rel(o8, ref8_out),
                    **{n: rel(g.astype(jnp.float32) / out_scale, r) for n, g, r in zip("qkv", (dq8, dk8, dv8), ref8)},
                    "max|g8|": [float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in (dq8, dk8, dv8)],
                    "max|ref|": [float(jnp.max(jnp.abs(r))) for r in ref8],
                    "amax": {n: float(dparams[n].reshape(())) for n in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")},
                    "dtypes": [str(g.dtype) for g in (dq8, dk8, dv8)],
                }
            except Exception as e:  # noqa: BLE001
                rec[f"direct_scale{out_scale:g}"] = repr(e)[:300]
        records["causal" if causal else "non_causal"] = rec
    print(json.dumps(records, indent=1))
    with open(os.path.join(args.out, "cudnn_fp8_probe.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
