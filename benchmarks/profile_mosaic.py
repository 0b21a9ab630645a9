"""One launch of the Mosaic GPU forward kernel at [4, 4096, 16, 128] on pre-quantized
operands, for Nsight Compute:

    ncu --clock-control none -k regex:dm_fp8 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/profile_mosaic.py
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from dm_jax import backends
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_MAIN
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles


def main(argv=None):
    case = dataclasses.replace(BENCH_MAIN, causal="--causal" in (argv or sys.argv[1:]))
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    spec = AttentionSpec(
        case.causal, "matched", "fp8", case.dqk**-0.5, default_tiles(case.dqk, case.dv)
    )
    kernel = backends.get("mosaic").passes(q, k, v, do, spec=spec, config=MosaicConfig())[
        "forward_kernel"
    ]
    run = jax.jit(kernel.fn)
    for _ in range(3):
        out = run(*kernel.args)[0]
    print(float(jnp.sum(out.astype(jnp.float32))))


if __name__ == "__main__":
    main()
