"""Kimi Delta Attention (KDA) mixer: Gated DeltaNet with a channel-wise decay gate.

  q, k, v, b    as in Gated DeltaNet (short conv, silu, L2-normalized q/k, sigmoid beta)
  log a_t       = -exp(A_log_h) * softplus(W_f2 W_f1 x_t + dt_bias)   one value per key channel
  S_t           = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t
  y             = W_o (RMSNorm(o) * sigmoid(W_g2 W_g1 x))   (low-rank output gate)

The decay and output-gate projections are low rank (rank = key_dim), as in Kimi Linear.
The chunked form materializes per-channel pair decays [C, C, K], hence a smaller chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax.nn.gated_deltanet import GatedDeltaNet
from dm_jax.nn.recurrence import init_dt_bias


class KimiDeltaAttention(GatedDeltaNet):
    """x_BTD -> y_BTD; same constructor as `GatedDeltaNet` (default chunk_size 32)."""

    @functools.wraps(GatedDeltaNet.__init__)
    def __init__(self, *args, chunk_size: int = 32, **kwargs):
        super().__init__(*args, chunk_size=chunk_size, **kwargs)

    def _init_gates(self, d_model, lin, rngs):
        H, K, V = self.H, self.K, self.V
        self.f_down, self.f_up = lin(d_model, K), lin(K, H * K)  # channel-wise decay, low rank
        self.g_down, self.g_up = lin(d_model, K), lin(K, H * V)  # output gate, low rank
        self.dt_bias = nnx.Param(init_dt_bias(rngs.params(), (H * K,)))

    def _gate_inputs(self) -> dict:
        return {"f": self.f_down, "g": self.g_down}  # the low-rank gates' first factors

    def _log_decay(self, proj):
        """log a_t = -exp(A_log_h) * softplus(W_f2 W_f1 x + dt_bias): [B, T, H, K]."""
        B, T, _ = proj["f"].shape
        f = self.f_up(proj["f"]).astype(jnp.float32) + self.dt_bias.get_value()
        A = jnp.exp(self.A_log.get_value())[:, None]  # [H, 1]
        return -A * jax.nn.softplus(f).reshape(B, T, self.H, self.K)

    def _output_gate(self, proj):
        return jax.nn.sigmoid(self.g_up(proj["g"]).astype(jnp.float32))
