"""Mamba-2 mixer with the SSD (state space duality) recurrence (Dao & Gu, 2024).

  [z, x, B, C, dt] = W_in u                  x: H heads of P channels, B/C: N (one group)
  x, B, C          = silu(conv4([x, B, C]))
  dt               = softplus(dt + dt_bias),  A = -exp(A_log)     (one scalar per head)
  h_t              = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T        (state [N, P] per head)
  y_t              = h_t^T C_t + D * x_t
  out              = W_out RMSNorm(y * silu(z))

This is the plain gated rule of `dm_jax.nn.recurrence` with q = C, k = B, v = x, b = dt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax.nn.fp8 import Linear, RMSNorm
from dm_jax.nn.recurrence import (
    check_chunk_local_name,
    check_state_pass,
    init_dt_bias,
    init_log_A,
    run_recurrence,
)
from dm_jax.nn.sequence import ShortConv


class Mamba2(nnx.Module):
    """u_BTD -> y_BTD with H = expand * d_model / head_dim heads; `impl`, `chunk_size`,
    `state_pass`, `scan_unroll` and `chunk_local` pick the recurrence's form as in
    `GatedDeltaNet`."""

    def __init__(
        self,
        d_model: int,
        *,
        head_dim: int = 64,
        state_dim: int = 64,
        expand: int = 2,
        conv_width: int = 4,
        impl: str = "chunked",
        chunk_size: int = 64,
        state_pass: str = "sequential",
        scan_unroll: int = 1,
        chunk_local: str = "xla",
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        check_state_pass(state_pass, scan_unroll)
        check_chunk_local_name(chunk_local)
        inner = expand * d_model
        if inner % head_dim:
            raise ValueError(
                f"head_dim: expand * d_model = {inner} must be divisible by {head_dim}"
            )
        H, P, N = inner // head_dim, head_dim, state_dim
        self.in_proj = Linear(d_model, 2 * inner + 2 * N + H, dtype=dtype, rngs=rngs)
        self.conv = ShortConv(inner + 2 * N, conv_width, rngs=rngs)
        self.A_log = nnx.Param(init_log_A(rngs.params(), (H,)))
        self.dt_bias = nnx.Param(init_dt_bias(rngs.params(), (H,)))
        self.D = nnx.Param(jnp.ones((H,), jnp.float32))
        self.norm = RMSNorm(inner)
        self.out_proj = Linear(inner, d_model, dtype=dtype, rngs=rngs, init_std=inner**-0.5)
        self.H, self.P, self.N, self.inner = H, P, N, inner
        self.impl, self.chunk_size = impl, chunk_size
        self.state_pass, self.scan_unroll = state_pass, scan_unroll
        self.chunk_local = chunk_local

    def __call__(self, u_BTD: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        Bt, T, _ = u_BTD.shape
        H, P, N, inner = self.H, self.P, self.N, self.inner
        z, xBC, dt = jnp.split(self.in_proj(u_BTD), [inner, 2 * inner + 2 * N], axis=-1)
        xBC = jax.nn.silu(self.conv(xBC, segment_ids))
        x, Bm, Cm = jnp.split(xBC, [inner, inner + N], axis=-1)
        x = x.reshape(Bt, T, H, P)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias.get_value())  # [B, T, H]
        log_a = (-jnp.exp(self.A_log.get_value()) * dt)[..., None]  # dt * A: [B, T, H, 1]
        k = jnp.broadcast_to(Bm[:, :, None, :], (Bt, T, H, N))
        q = jnp.broadcast_to(Cm[:, :, None, :], (Bt, T, H, N))
        y = run_recurrence(
            q,
            k,
            x,
            log_a,
            dt,
            delta_rule=False,
            segment_ids=segment_ids,
            impl=self.impl,
            chunk_size=self.chunk_size,
            state_pass=self.state_pass,
            scan_unroll=self.scan_unroll,
            chunk_local=self.chunk_local,
        )
        y = y + self.D.get_value()[:, None] * x.astype(jnp.float32)
        y = y.reshape(Bt, T, inner) * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(self.norm(y).astype(u_BTD.dtype))
