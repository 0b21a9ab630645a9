"""Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh, "Gated Delta Networks").

  q, k, v = silu(conv4(W_q x)), silu(conv4(W_k x)), silu(conv4(W_v x))   per head
  q, k    = q / ||q||, k / ||k||  (L2 norm per head),  q *= K^-1/2
  log a_t = -exp(A_log) * softplus(W_a x_t + dt_bias)   (decay gate, one per head)
  b_t     = sigmoid(W_b x_t)                             (delta-rule step size)
  S_t     = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t
  y       = W_o (RMSNorm(o) * silu(W_g x))               (gated output norm, per head)

The recurrence itself lives in `dm_jax.nn.recurrence` (naive and chunked forms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax.nn.fp8 import Linear, RMSNorm, fused_linear, split_widths
from dm_jax.nn.recurrence import (
    check_chunk_local_name,
    check_state_pass,
    init_dt_bias,
    init_log_A,
    run_recurrence,
)
from dm_jax.nn.sequence import ShortConv, short_conv

QKV = ("q", "k", "v")


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


class ConvQKV(nnx.Module):
    """Delta-rule inputs: q, k, v = silu(conv(W x)) per head, q/k L2-normalized, q *= K^-1/2."""

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        conv_width: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        H, K, V = num_heads, key_dim, value_dim
        widths = {"q": H * K, "k": H * K, "v": H * V}
        self.proj = nnx.Dict(
            {n: Linear(d_model, w, dtype=dtype, rngs=rngs) for n, w in widths.items()}
        )
        self.conv = nnx.Dict({n: ShortConv(w, conv_width, rngs=rngs) for n, w in widths.items()})
        self.H, self.K, self.V = H, K, V

    def __call__(self, x_BTD, segment_ids=None):
        return self.from_projections({n: self.proj[n](x_BTD) for n in QKV}, segment_ids)

    def from_projections(self, proj, segment_ids=None, fused_conv: bool = False):
        """q, k, v from the projections W_q x, W_k x, W_v x (`proj`: name -> [B, T, width]).
        `fused_conv`: the three depthwise convolutions as one over their channels side by
        side (each channel is its own, so the values are the same)."""
        if fused_conv:
            kernel = jnp.concatenate([self.conv[n].kernel[...] for n in QKV], axis=1)
            y = short_conv(jnp.concatenate([proj[n] for n in QKV], axis=-1), kernel, segment_ids)
            widths = [self.conv[n].kernel.shape[1] for n in QKV]
            qkv = dict(zip(QKV, split_widths(jax.nn.silu(y), widths)))
        else:
            qkv = {n: jax.nn.silu(self.conv[n](proj[n], segment_ids)) for n in QKV}
        B, T, _ = proj["q"].shape
        qkv = {n: x.reshape(B, T, self.H, -1) for n, x in qkv.items()}
        return (l2_normalize(qkv["q"]) * self.K**-0.5, l2_normalize(qkv["k"]), qkv["v"])


class GatedDeltaNet(nnx.Module):
    """x_BTD -> y_BTD. `impl` picks the chunked (default) or naive recurrence; `chunk_size`,
    `state_pass`, `scan_unroll` and `chunk_local` configure the chunked one
    (`recurrent_chunked`).
    `fused_projections`: the six projections of x (q, k, v, beta and the two gates' inputs)
    as one matmul and the three short convolutions as one (`fused_linear`; the same
    parameters, values equal to bf16 rounding).

    Subclasses change the decay gate (`_log_decay`), the output gate (`_output_gate`) and
    the gates' projections of x (`_gate_inputs`).
    """

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        conv_width: int = 4,
        impl: str = "chunked",
        chunk_size: int = 64,
        state_pass: str = "sequential",
        scan_unroll: int = 1,
        chunk_local: str = "xla",
        fused_projections: bool = False,
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        check_state_pass(state_pass, scan_unroll)
        check_chunk_local_name(chunk_local)
        H, K, V = num_heads, key_dim, value_dim
        self.H, self.K, self.V = H, K, V
        self.fused_projections = fused_projections
        self.impl, self.chunk_size = impl, chunk_size
        self.state_pass, self.scan_unroll = state_pass, scan_unroll
        self.chunk_local = chunk_local
        self.qkv = ConvQKV(
            d_model,
            num_heads=H,
            key_dim=K,
            value_dim=V,
            conv_width=conv_width,
            dtype=dtype,
            rngs=rngs,
        )
        self.b_proj = Linear(d_model, H, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(H * V, d_model, dtype=dtype, rngs=rngs, init_std=(H * V) ** -0.5)
        self.A_log = nnx.Param(init_log_A(rngs.params(), (H,)))
        self.o_norm = RMSNorm(V)
        self._init_gates(d_model, lambda i, o: Linear(i, o, dtype=dtype, rngs=rngs), rngs)

    def _init_gates(self, d_model, lin, rngs):
        self.a_proj, self.g_proj = lin(d_model, self.H), lin(d_model, self.H * self.V)
        self.dt_bias = nnx.Param(init_dt_bias(rngs.params(), (self.H,)))

    def _gate_inputs(self) -> dict:
        """The gates' projections of x, by name (`_log_decay`, `_output_gate` read them)."""
        return {"a": self.a_proj, "g": self.g_proj}

    def _log_decay(self, proj):
        """log a_t = -exp(A_log) * softplus(W_a x + dt_bias): [B, T, H, 1]."""
        dt = jax.nn.softplus(proj["a"].astype(jnp.float32) + self.dt_bias.get_value())
        return (-jnp.exp(self.A_log.get_value()) * dt)[..., None]

    def _output_gate(self, proj):
        return jax.nn.silu(proj["g"].astype(jnp.float32))

    def _projections(self, x_BTD) -> dict:
        """Every projection of x, by name: q, k, v, b and the gates' inputs."""
        linears = {**{n: self.qkv.proj[n] for n in QKV}, "b": self.b_proj, **self._gate_inputs()}
        if self.fused_projections:
            return dict(zip(linears, fused_linear(x_BTD, list(linears.values()))))
        return {n: lin(x_BTD) for n, lin in linears.items()}

    def __call__(self, x_BTD: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        B, T, _ = x_BTD.shape
        proj = self._projections(x_BTD)
        q, k, v = self.qkv.from_projections(proj, segment_ids, self.fused_projections)
        beta = jax.nn.sigmoid(proj["b"].astype(jnp.float32))
        o = run_recurrence(
            q,
            k,
            v,
            self._log_decay(proj),
            beta,
            delta_rule=True,
            segment_ids=segment_ids,
            impl=self.impl,
            chunk_size=self.chunk_size,
            state_pass=self.state_pass,
            scan_unroll=self.scan_unroll,
            chunk_local=self.chunk_local,
        )
        gate = self._output_gate(proj).reshape(B, T, self.H, self.V)
        o = (self.o_norm(o) * gate).astype(x_BTD.dtype).reshape(B, T, self.H * self.V)
        return self.o_proj(o)
