"""Runs the chunk-local kernels' forward and backward a few times, for Nsight Compute.

    ncu --clock-control none -k regex:chunk_local --launch-skip 3 --launch-count 3 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section LaunchStats -f -o chunk_local python3 benchmarks/profile_chunk_local.py

(`bash benchmarks/h200_chunk_local.sh profile` does this.) gdn_gqa-569m's GDN layer (B 8,
T 4096, H 8, K = V = 128, C 64, inputs as `recurrence_speed.inputs`): jax.value_and_grad of
a random linear function of the six operands of `pallas_chunk_local`, --calls times (each
call launches the forward, then the backward's pairs and solve kernels).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.recurrence_speed import SHAPES, inputs
from dm_jax.nn.chunk_local_pallas import pallas_chunk_local


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    s = SHAPES["569m"]
    q, k, v, g, b = inputs(s, seed=2)
    seg = jnp.zeros((s.b, s.t), jnp.int32)
    carried = jnp.ones((s.b, s.t), jnp.float32)

    def loss(q, k, v, g, b):
        outs = pallas_chunk_local(
            q, k, v, g[..., 0], b, seg, carried, chunk_size=64, delta_rule=True
        )
        return sum(jnp.sum(o * jnp.cos(jnp.float32(i))) for i, o in enumerate(outs))

    step = jax.jit(jax.value_and_grad(loss, argnums=range(5)))
    for _ in range(args.calls):
        value, _ = jax.block_until_ready(step(q, k, v, g, b))
    print("loss", float(value))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
