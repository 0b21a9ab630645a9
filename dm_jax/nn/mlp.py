"""SwiGLU feed-forward block: y = W_down (silu(W_gate x) * (W_up x)).

`fp8=True` runs all three matmuls (and their backward matmuls) in FP8 with current scaling
(`dm_jax.nn.fp8`, granularity `fp8_scaling`): the paper's `ffn` precision scope, on in every
arm by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax.nn.fp8 import Linear


class SwiGLU(nnx.Module):
    """x_BTD -> y_BTD through a hidden width `hidden`."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        fp8: bool = False,
        fp8_scaling: str = "per_token",
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        lin = dict(fp8=fp8, fp8_scaling=fp8_scaling, dtype=dtype, rngs=rngs)
        self.gate_up = Linear(d_model, 2 * hidden, **lin)
        self.down = Linear(hidden, d_model, init_std=hidden**-0.5, **lin)
        self.hidden = hidden

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x_BTD), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)
