"""Does an FP8 wgmma give bitwise the same sums when its operands swap sides?

The Mosaic backward forms S and dP^ twice: as Q8 K8^T in the query pass (where the matched
delta and dQ are formed) and as K8 Q8^T in the key pass (dK, dV). Delta-Matching needs the
dS of both passes to be bitwise equal, so both orientations of every [64 x 64] FP8 dot must
agree to the bit. This checks it on the GPU for random e4m3 tiles over the head dims the
backward runs (never zeros: values of a realistic spread, scaled like the contract's).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/wgmma_transpose.py --out $OUT

Writes wgmma_transpose.json: per head dim and trial, the share of entries that differ.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_attention.mosaic_gpu.forward import fp8_transforms

TILE = 64


def both_orientations(a8, b8):
    """(a8 @ b8^T, b8 @ a8^T) [64, 64] f32 for e4m3 a8, b8 [64, D], in one kernel."""
    d = a8.shape[1]

    def kernel(a_ref, b_ref, ab_ref, ba_ref):
        def body(a_smem, b_smem, ab_smem, ba_smem, bar):
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[1])
            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_wait(bar.at[1])

            def dots(acc1, acc2):
                plgpu.wgmma(acc1, a_smem, b_smem.T)
                plgpu.wgmma(acc2, b_smem, a_smem.T)
                return acc1[...], acc2[...]

            shape = (TILE, TILE)
            ab, ba = pl.run_scoped(dots, plgpu.ACC(shape), plgpu.ACC(shape))
            ab_smem[...] = ab
            ba_smem[...] = ba
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ab_smem, ab_ref)
            plgpu.copy_smem_to_gmem(ba_smem, ba_ref)
            plgpu.wait_smem_to_gmem(0)

        fp8 = jnp.float8_e4m3fn
        pl.run_scoped(
            body,
            plgpu.SMEM((TILE, d), fp8, transforms=fp8_transforms(d)),
            plgpu.SMEM((TILE, d), fp8, transforms=fp8_transforms(d)),
            plgpu.SMEM((TILE, TILE), jnp.float32),
            plgpu.SMEM((TILE, TILE), jnp.float32),
            plgpu.Barrier(num_barriers=2),
        )

    out = jax.ShapeDtypeStruct((TILE, TILE), jnp.float32)
    return plgpu.kernel(kernel, out_type=[out, out])(a8, b8)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--trials", type=int, default=20)
    args = p.parse_args(argv)
    rows = []
    fn = jax.jit(both_orientations)
    for d in (64, 128):
        for trial in range(args.trials):
            ka, kb = jax.random.split(jax.random.PRNGKey(trial))
            # heavy-tailed values over the whole e4m3 range of a scaled operand
            a = jax.random.t(ka, 3.0, (TILE, d)) * 64
            b = jax.random.t(kb, 3.0, (TILE, d)) * 64
            a8 = jnp.clip(a, -448, 448).astype(jnp.float8_e4m3fn)
            b8 = jnp.clip(b, -448, 448).astype(jnp.float8_e4m3fn)
            ab, ba = fn(a8, b8)
            exact = a8.astype(jnp.float32) @ b8.astype(jnp.float32).T
            differ = float(jnp.mean(ab != ba.T))
            rows.append(
                dict(
                    head_dim=d,
                    trial=trial,
                    share_differing=differ,
                    max_abs_diff=float(jnp.max(jnp.abs(ab - ba.T))),
                    max_rel_err_vs_f32=float(
                        jnp.max(jnp.abs(ab - exact)) / jnp.max(jnp.abs(exact))
                    ),
                )
            )
    with open(os.path.join(args.out, "wgmma_transpose.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f)
    for d in (64, 128):
        sel = [r for r in rows if r["head_dim"] == d]
        worst = max(r["share_differing"] for r in sel)
        print(
            f"D={d}: {len(sel)} trials, worst share of differing entries {worst:.4f}, "
            f"max |AB - (BA)^T| {max(r['max_abs_diff'] for r in sel):.3g}, "
            f"max rel err vs f32 {max(r['max_rel_err_vs_f32'] for r in sel):.2e}"
        )


if __name__ == "__main__":
    main()
