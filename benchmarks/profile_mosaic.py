"""One pass of the Mosaic GPU backend at [4, 4096, 16, 128] (``--shape``: another benchmark
shape) on its own inputs (the forward kernel on pre-quantized operands by default), for
Nsight Compute or ptxas' report (``MOSAIC_GPU_DUMP_PTXAS=1``):

    ncu --clock-control none -k regex:dm_fp8 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/profile_mosaic.py \\
        [--causal] [--pass forward_kernel|delta_matched_kernel|dq_pass|dkdv_pass]

Every pass runs three times; skip two launches of the kernel named by ``-k`` to profile the
third. The backward passes' kernels are named dm_fp8_attention_query_pass_mosaic (delta,
dQ) and dm_fp8_attention_key_pass_mosaic (dK/dV).

A shape with documents (``--shape h569m_t4096_docs``) runs the whole forward and backward
of ``dm_jax.attention`` with its segment ids three times instead (the passes take no
segment ids): per run one forward launch, two query-pass launches (delta, dQ) and the key
pass's, so ``--launch-skip 2`` profiles the third forward or the second delta pass.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import dm_jax
from dm_jax import backends
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.arg_specs import BENCH_SHAPES
from pallas_kernels.fp8_attention.mosaic_gpu.config import MosaicConfig
from pallas_kernels.fp8_attention.tiles import default_tiles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pass", dest="name", default="forward_kernel", help="a key of ops.passes")
    p.add_argument("--shape", default="main", choices=sorted(BENCH_SHAPES))
    args = p.parse_args(argv)
    case = dataclasses.replace(BENCH_SHAPES[args.shape], causal=args.causal)
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    spec = AttentionSpec(
        case.causal, "matched", "fp8", case.dqk**-0.5, default_tiles(case.dqk, case.dv)
    )
    if case.segment_len:  # documents: the whole call, with its segment ids
        ids = case.segment_ids()[0]

        def attention(q, k, v):
            return dm_jax.attention(
                q, k, v, causal=case.causal, segment_ids=ids, implementation="mosaic"
            )

        def step(q, k, v, do):
            out, vjp = jax.vjp(attention, q, k, v)
            return (out,) + vjp(do)

        run = jax.jit(step)
        for _ in range(3):
            out = run(q, k, v, do)
        print("attention with documents", [float(jnp.sum(x.astype(jnp.float32))) for x in out])
        return
    plan = backends.get("mosaic").passes(q, k, v, do, spec=spec, config=MosaicConfig())
    if args.name not in plan:
        p.error(f"--pass: unknown {args.name!r}; choose from {sorted(plan)}")
    one = plan[args.name]
    run = jax.jit(one.fn)
    for _ in range(3):
        out = jax.tree.leaves(run(*one.args))
    print(args.name, [float(jnp.sum(x.astype(jnp.float32))) for x in out])


if __name__ == "__main__":
    main()
