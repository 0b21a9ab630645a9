"""One launch of the Mosaic GPU forward kernel at [4, 4096, 16, 128] on pre-quantized
operands, for Nsight Compute:

    ncu --clock-control none -k regex:dm_fp8 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/profile_mosaic.py
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd_kernel
from pallas_kernels.fp8_attention.mosaic_gpu.quantize import quantize
from tests.shapes import BENCH_MAIN


def main(argv=None):
    causal = "--causal" in (argv or sys.argv[1:])
    case = BENCH_MAIN
    q, k, v, _ = case.arrays(seed=0, dtype=jnp.bfloat16)
    q8, k8, v8 = quantize(q), quantize(k), quantize(v, values=False, k_major=True)
    kv_inv = jnp.stack([k8.inv_rows, v8.inv_rows], axis=3)
    mask = fwd_kernel.ForwardMask(t=case.t, s=case.s, causal=causal, segments=False)
    run = jax.jit(lambda *a: fwd_kernel.forward(*a, mask=mask, sm_scale=case.dqk ** -0.5,
                                                stages=2, out_dtype=jnp.bfloat16)[0])
    for _ in range(3):
        out = run(q8.values, q8.inv_tokens, k8.values, v8.values_t, kv_inv)
    print(float(jnp.sum(out.astype(jnp.float32))))


if __name__ == "__main__":
    main()
