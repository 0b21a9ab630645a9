"""Softmax attention layers: grouped-query attention (GQA) and multi-head latent attention
(MLA), both causal, with optional QK-norm and RoPE, and a selectable attention core.

QK-norm: q and k are RMS-normalized per head over their head dim and multiplied by learned
per-channel gains g_q, g_k (shape [Dqk], shared by all heads), so logit channel c carries
the factor g_q,c * g_k,c; `dm_jax.models.qk_gains` reads them for the channel-gain
diagnostics. Norm first, then RoPE (as in Qwen3 / OLMo-2).

MLA (DeepSeek-V2): queries come from a low-rank latent (optional), keys/values from a shared
latent c_kv of rank `kv_lora_rank` (RMS-normalized, as in DeepSeek), plus a decoupled RoPE
key of width `rope_dim` shared by all heads:
  q_h = [q_nope_h, q_rope_h],   k_h = [k_nope_h(c_kv), k_rope(x)],   v_h = v_h(c_kv)
so Dqk = nope_dim + rope_dim and Dv = v_dim may differ (192 / 128 by default at scale).
Where MLA's QK-norm gains live: on the assembled per-head q and k (all Dqk channels, the
nope part and the decoupled RoPE part), applied before RoPE, exactly like GQA. That keeps
the gains on the channels whose products form the logits, so the top-channel share of
sum_c (g_q,c g_k,c)^2 means the same thing for both layer types. The latent norms of MLA
(on c_q and c_kv) are kept as well; they do not act channel-wise on the logits.

Probing: `probe_BTHV` (zeros) is added to the core output, so d loss / d probe = dO; the
dict `capture`, when given, receives the exact q, k, v fed to the core.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dm_jax.arms import check_arm
from dm_jax.nn.attention_core import attention_core
from dm_jax.nn.fp8 import Linear, RMSNorm
from dm_jax.nn.sequence import apply_rope, positions


class _AttentionBase(nnx.Module):
    """Shared tail: QK-norm, RoPE, core, probe/capture, output projection."""

    def _setup_common(
        self,
        *,
        qk_dim,
        qk_norm,
        rope,
        rope_theta,
        rope_dim,
        arm,
        implementation,
        core_precision,
        cudnn_documents,
    ):
        self.core_precision = check_arm(arm, core_precision)
        self.cudnn_documents = cudnn_documents
        self.q_norm = RMSNorm(qk_dim) if qk_norm else None
        self.k_norm = RMSNorm(qk_dim) if qk_norm else None
        self.rope, self.rope_theta, self.rope_dim = rope, rope_theta, rope_dim
        self.arm, self.implementation = arm, implementation

    def core(self, q_BTHD, k_BSKD, v_BSKV, *, segment_ids=None):
        """This layer's causal attention core (its arm and core precision) -> o_BTHV."""
        return attention_core(
            q_BTHD,
            k_BSKD,
            v_BSKV,
            arm=self.arm,
            causal=True,
            segment_ids=segment_ids,
            implementation=self.implementation,
            precision=self.core_precision,
            documents=self.cudnn_documents,
        )

    def _attend(self, q, k, v, segment_ids, probe, capture):
        B, T = q.shape[:2]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            pos = positions(B, T, segment_ids)
            r = self.rope_dim  # RoPE on the last r channels (all of them for GQA)
            rot = lambda x: jnp.concatenate(
                [x[..., :-r], apply_rope(x[..., -r:], pos, theta=self.rope_theta)], axis=-1
            )
            q, k = rot(q), rot(k)
        if capture is not None:
            capture.update(q=q, k=k, v=v)
        with jax.named_scope("attention_core"):  # labels the core in profiles
            o = self.core(q, k, v, segment_ids=segment_ids)
        if probe is not None:
            o = o + probe.astype(o.dtype)
        return self.o_proj(o.reshape(B, T, -1))


class GQAttention(_AttentionBase):
    """Grouped-query attention: x_BTD -> y_BTD with num_heads query heads sharing
    num_kv_heads key/value heads of width head_dim."""

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = True,
        rope: bool = True,
        rope_theta: float = 10000.0,
        arm: str = "matched",
        implementation: str | None = None,
        core_precision: str | None = None,
        cudnn_documents: str = "packed",
        proj_fp8: bool = False,
        fp8_scaling: str = "per_token",
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: {num_kv_heads} must divide num_heads {num_heads}")
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        lin = lambda i, o, **kw: Linear(
            i, o, fp8=proj_fp8, fp8_scaling=fp8_scaling, dtype=dtype, rngs=rngs, **kw
        )
        self.q_proj, self.k_proj, self.v_proj = (
            lin(d_model, H * D),
            lin(d_model, Hkv * D),
            lin(d_model, Hkv * D),
        )
        self.o_proj = lin(H * D, d_model, init_std=(H * D) ** -0.5)
        self._setup_common(
            qk_dim=D,
            qk_norm=qk_norm,
            rope=rope,
            rope_theta=rope_theta,
            rope_dim=D,
            arm=arm,
            implementation=implementation,
            core_precision=core_precision,
            cudnn_documents=cudnn_documents,
        )
        self.H, self.Hkv, self.D = H, Hkv, D

    def __call__(self, x_BTD: jax.Array, *, segment_ids=None, probe=None, capture=None):
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).reshape(B, T, self.H, self.D)
        k = self.k_proj(x_BTD).reshape(B, T, self.Hkv, self.D)
        v = self.v_proj(x_BTD).reshape(B, T, self.Hkv, self.D)
        return self._attend(q, k, v, segment_ids, probe, capture)


class MLAttention(_AttentionBase):
    """Multi-head latent attention: x_BTD -> y_BTD (see the module docstring)."""

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        kv_lora_rank: int,
        q_lora_rank: int | None,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        qk_norm: bool = True,
        rope: bool = True,
        rope_theta: float = 10000.0,
        arm: str = "matched",
        implementation: str | None = None,
        core_precision: str | None = None,
        cudnn_documents: str = "packed",
        proj_fp8: bool = False,
        fp8_scaling: str = "per_token",
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        H = num_heads
        lin = lambda i, o, **kw: Linear(
            i, o, fp8=proj_fp8, fp8_scaling=fp8_scaling, dtype=dtype, rngs=rngs, **kw
        )
        if q_lora_rank:
            self.q_down, self.q_latent_norm = lin(d_model, q_lora_rank), RMSNorm(q_lora_rank)
            self.q_up = lin(q_lora_rank, H * (nope_dim + rope_dim))
        else:
            self.q_down, self.q_latent_norm = None, None
            self.q_up = lin(d_model, H * (nope_dim + rope_dim))
        self.kv_down = lin(d_model, kv_lora_rank + rope_dim)
        self.kv_latent_norm = RMSNorm(kv_lora_rank)
        self.kv_up = lin(kv_lora_rank, H * (nope_dim + v_dim))
        self.o_proj = lin(H * v_dim, d_model, init_std=(H * v_dim) ** -0.5)
        self._setup_common(
            qk_dim=nope_dim + rope_dim,
            qk_norm=qk_norm,
            rope=rope,
            rope_theta=rope_theta,
            rope_dim=rope_dim,
            arm=arm,
            implementation=implementation,
            core_precision=core_precision,
            cudnn_documents=cudnn_documents,
        )
        self.H, self.nope_dim, self.v_dim, self.kv_lora_rank = H, nope_dim, v_dim, kv_lora_rank

    def __call__(self, x_BTD: jax.Array, *, segment_ids=None, probe=None, capture=None):
        B, T, _ = x_BTD.shape
        H, dn, dr, dv = self.H, self.nope_dim, self.rope_dim, self.v_dim
        cq = x_BTD if self.q_down is None else self.q_latent_norm(self.q_down(x_BTD))
        q = self.q_up(cq).reshape(B, T, H, dn + dr)
        ckv, k_rope = jnp.split(self.kv_down(x_BTD), [self.kv_lora_rank], axis=-1)
        kv = self.kv_up(self.kv_latent_norm(ckv)).reshape(B, T, H, dn + dv)
        k_nope, v = jnp.split(kv, [dn], axis=-1)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (B, T, H, dr))  # shared by all heads
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        return self._attend(q, k, v, segment_ids, probe, capture)
