"""Mosaic GPU FP8 forward on the GPU: correctness on every feature, then speed beside the
Triton forward, cuDNN FP8 and cuDNN BF16, in one process.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mosaic_forward.py --out $OUT

Correctness: relative Frobenius error of the output against f32 attention
(``reference.mha_reference``) and against the blockwise emulation of the same numerics
(``reference.flash_forward`` with 128-key tiles), and the largest |lse - lse_emulation|.
Timing: ``benchmarks.attention.time_step`` (jitted loop over two input sets, median of
``reps``); "e2e" arms start from bf16 inputs (quantize included), "kernel" arms from
pre-quantized operands. TFLOP/s = 2 B H T S (Dqk + Dv) (causal: half) / time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import dm_jax
from benchmarks.attention import cudnn_bf16, time_step
from dm_jax import backends, reference
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES, Case
from pallas_kernels.fp8_attention.mosaic_gpu import ops
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import quantize_in_input_layout
from pallas_kernels.fp8_attention.tiles import default_tiles

CHECKS = (
    Case("d64", 1, 512, 512, 4, 4, 64, 64),
    Case("d128_causal", 1, 1024, 1024, 4, 4, 128, 128, causal=True),
    Case("ragged_gqa_causal", 2, 300, 200, 4, 2, 64, 64, causal=True),
    Case("ragged_cross", 1, 333, 517, 2, 1, 128, 128),
    Case("mla_segments", 2, 640, 640, 4, 1, 192, 128, causal=True, segment_len=150),
    Case("d256", 1, 512, 512, 2, 2, 256, 256),
    Case("d256_causal_segments", 1, 384, 384, 2, 2, 256, 256, causal=True, segment_len=100),
    Case("t4096_causal", 1, 4096, 4096, 2, 2, 128, 128, causal=True),
)


def fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def spec_of(case: Case) -> AttentionSpec:
    return AttentionSpec(
        case.causal, case.delta, case.precision, case.dqk**-0.5, default_tiles(case.dqk, case.dv)
    )


def check(case: Case):
    q, k, v, _ = case.arrays(seed=1)
    ids = case.segment_ids()
    mosaic = backends.get("mosaic")
    out, lse = jax.jit(
        lambda q, k, v, ids: mosaic.forward(
            q, k, v, *(ids or (None, None)), spec=spec_of(case), config=MosaicConfig()
        )
    )(q, k, v, ids)
    ref = reference.mha_reference(q, k, v, causal=case.causal, segment_ids=ids)
    emu, emu_lse = reference.flash_forward(
        q,
        k,
        v,
        ids,
        causal=case.causal,
        sm_scale=case.dqk**-0.5,
        precision="fp8",
        block_q=64,
        block_k=128,
    )
    finite = np.isfinite(np.asarray(emu_lse))
    row = dict(
        case=case.name,
        finite=bool(np.isfinite(np.asarray(out)).all()),
        err_f32=fro(out, ref),
        err_emulation=fro(out, emu),
        lse_max_diff=float(np.max(np.abs(np.asarray(lse) - np.asarray(emu_lse))[finite])),
        lse_inf_match=bool(np.array_equal(finite, np.isfinite(np.asarray(lse)))),
    )
    # the Triton forward on the same inputs, for scale
    tri = dm_jax.attention(q, k, v, causal=case.causal, segment_ids=ids, implementation="triton")
    row["triton_err_f32"] = fro(tri, ref)
    return row


def speed_arms(case: Case):
    def mosaic(fused):
        config = MosaicConfig(fused_quantize=fused)
        return lambda q, k, v: dm_jax.attention(
            q, k, v, causal=case.causal, implementation="mosaic", config=config
        )

    arms = {
        "mosaic_e2e": mosaic(True),
        "mosaic_e2e_xla_quantize": mosaic(False),
        "triton_e2e": lambda q, k, v: dm_jax.attention(
            q, k, v, causal=case.causal, implementation="triton"
        ),
        "cudnn_bf16": lambda q, k, v: cudnn_bf16(q, k, v, case.causal),
    }
    if case.dqk == case.dv == 128:
        from dm_jax.baselines import cudnn_fp8_attention

        arms["cudnn_fp8_e2e"] = lambda q, k, v: cudnn_fp8_attention(q, k, v, causal=case.causal)
    return arms


def kernel_only(case: Case, sets, iters, reps, stages):
    """The forward kernel (the backend's ``forward_kernel`` pass) on pre-quantized operands."""
    config = MosaicConfig(stages=stages)
    prepared, fn = [], None
    for q, k, v, do in sets:
        p = backends.get("mosaic").passes(q, k, v, do, spec=spec_of(case), config=config)[
            "forward_kernel"
        ]
        fn = p.fn
        q8, q_inv, k8, vt8, kv_inv = p.args
        # the timing loop perturbs the first operand: the f32 factors, not an FP8 tensor
        prepared.append((kv_inv, q8, q_inv, (k8, vt8)))

    def step(kv_inv, q8, q_inv, rest):
        return fn(q8, q_inv, *rest, kv_inv)[:1]

    return time_step(step, prepared, iters, reps)


def quantize_arms():
    """arm -> step (q, k, v, do) -> the forward's FP8 operands: the quantize pre-pass alone."""

    def through(config):
        return lambda q, k, v, do: tuple(
            x.values if x.values is not None else x.values_t
            for x in ops.quantize_operands(q, k, v, config)
        )

    def input_layout(q, k, v, do):
        qil = quantize_in_input_layout
        return qil(q).values, qil(k).values, qil(v, values=False, k_major=True).values_t

    return {
        "quantize_q_k_v": through(MosaicConfig(fused_quantize=False)),
        "quantize_q_k_v_fused_kernel": through(MosaicConfig()),
        "quantize_q_k_v_input_layout": input_layout,
    }


def timed_row(case_name, causal, arm, timer, flops):
    """One speed record: ``timer()`` -> (median, min, max) seconds; an error is recorded."""
    row = dict(case=case_name, causal=causal, arm=arm)
    try:
        med, _, _ = timer()
        row.update(ms=med * 1e3, tflops=flops / med / 1e12)
    except Exception as e:
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:800]}"
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", default="main,d64,d256,d192_128")
    p.add_argument("--skip-checks", action="store_true")
    args = p.parse_args(argv)
    print("jax", jax.__version__, jax.devices(), flush=True)
    result = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, checks=[], speed=[])
    if not args.skip_checks:
        for case in CHECKS:
            try:
                row = check(case)
            except Exception as e:
                traceback.print_exc()
                row = dict(case=case.name, error=f"{type(e).__name__}: {str(e)[:1500]}")
            print(json.dumps(row), flush=True)
            result["checks"].append(row)
    for name in args.shapes.split(","):
        for causal in (False, True):
            case = dataclasses.replace(BENCH_SHAPES[name], causal=causal)
            sets = [case.arrays(seed=s, dtype=jnp.bfloat16) for s in (0, 1)]
            arms = (
                speed_arms(case)
                if name == "main"
                else {
                    k: v
                    for k, v in speed_arms(case).items()
                    if k in ("mosaic_e2e", "triton_e2e", "cudnn_bf16")
                }
            )
            for arm, fn in arms.items():
                timer = lambda fn=fn: time_step(  # noqa: E731
                    lambda q, k, v, do: (fn(q, k, v),), sets, args.iters, args.reps
                )
                result["speed"].append(timed_row(name, causal, arm, timer, case.flops_fwd))
            if name == "main":
                for arm, quantize_all in quantize_arms().items():
                    timer = lambda f=quantize_all: time_step(f, sets, args.iters, args.reps)  # noqa: E731
                    result["speed"].append(timed_row(name, causal, arm, timer, 0.0))
                for stages in (2, 3):
                    timer = lambda st=stages: kernel_only(case, sets, args.iters, args.reps, st)  # noqa: E731
                    arm = f"mosaic_kernel_stages{stages}"
                    result["speed"].append(timed_row(name, causal, arm, timer, case.flops_fwd))
    with open(os.path.join(args.out, "mosaic_forward.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n| case | finite | err vs f32 | err vs emulation | lse diff | triton err vs f32 |")
    for r in result["checks"]:
        if "error" in r:
            print(f"| {r['case']} | ERROR {r['error'][:150]} |")
        else:
            print(
                f"| {r['case']} | {r['finite']} | {r['err_f32']:.4f} | {r['err_emulation']:.2e} | "
                f"{r['lse_max_diff']:.1e} {r['lse_inf_match']} | {r['triton_err_f32']:.4f} |"
            )
    print("\n| shape | causal | arm | ms | TFLOP/s |")
    for r in result["speed"]:
        if "error" in r:
            print(f"| {r['case']} | {r['causal']} | {r['arm']} | ERROR {r['error'][:120]} |")
        else:
            print(
                f"| {r['case']} | {r['causal']} | {r['arm']} | {r['ms']:.3f} | {r['tflops']:.0f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
