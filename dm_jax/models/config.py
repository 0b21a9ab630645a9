"""`HybridConfig`: one frozen dataclass describes a hybrid language model.

A model is `embed -> [layer_i for kind_i in pattern] -> RMSNorm -> LM head`; every layer is
pre-norm `x += mixer(norm(x)); x += SwiGLU(norm(x))`, the mixer picked by its kind:

  "gdn"     Gated DeltaNet                  "mamba2"  Mamba-2 (SSD)
  "kda"     Kimi Delta Attention            "attn"    grouped-query softmax attention
  "mla"     multi-head latent attention

Precision scopes (the paper's recipe): `ffn` (SwiGLU matmuls), `attn_proj` (q/k/v/o and MLA
projections), `attn_core` (the softmax-attention core). `None` means "what the attention arm
implies": the FP8 arms (matched, do_matched, stale, cudnn_fp8) quantize projections and core,
the reference/bf16 arms keep both in high precision; FFNs are FP8 in every arm by default.
Mixer projections (GDN, KDA, Mamba-2) stay in bf16. `fp8_scaling` sets the scale
granularity of every FP8 linear layer (`dm_jax.nn.fp8.SCALINGS`): "per_token" (default)
keeps the model causal and the sequences of a batch independent; "per_tensor" is the older
rule, kept for comparison. `cudnn_documents` sets how the `cudnn_bf16` arm hands packed
documents to cuDNN: "packed" (default: cuDNN's packed sequences,
`dm_jax.baselines.cudnn_bf16_documents`) or "mask" (a dense [B, 1, T, S] mask, which
doubles cuDNN's time).

Compilation: with `scan_layers` (the default) the repeats of the layer group (the shortest
period of `pattern`, e.g. 6 x (gdn, gdn, gdn, attn)) run as one `lax.scan`, so XLA compiles
the group once; the parameters, and so checkpoints, are the same either way. `remat` picks
what the backward pass recomputes instead of keeping (`REMAT_POLICIES`): "none" keeps every
residual, "full" recomputes each layer group, "dots" keeps only matmul outputs.
`state_pass` ("sequential" lax.scan, `state_scan_unroll` steps per iteration,
"associative", "pallas": one kernel per direction, or "auto", the default: "pallas" on a GPU
where its kernels take the shapes, else "sequential") picks how the recurrent mixers carry
their state across chunks: the same math on another schedule (docs/models.md, "Recurrent
state passes").
"""

from __future__ import annotations

import dataclasses

import jax

from dm_jax.arms import ARMS, FP8_ARMS, check_arm
from dm_jax.backends import IMPLEMENTATIONS
from dm_jax.baselines import check_documents
from dm_jax.nn.fp8 import check_scaling
from dm_jax.nn.recurrence import check_chunk_local_name, check_state_pass, resolve_state_pass

MIXER_KINDS = ("gdn", "mamba2", "kda")
ATTENTION_KINDS = ("attn", "mla")
LAYER_KINDS = MIXER_KINDS + ATTENTION_KINDS
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Hyperparameters of `dm_jax.models.HybridLM` (all sizes in elements)."""

    vocab_size: int = 256
    d_model: int = 64
    pattern: tuple = ("gdn", "gdn", "gdn", "attn")
    mlp_hidden: int = 128
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    compute_dtype: str = "bfloat16"
    # softmax attention ("attn" = GQA, "mla")
    attention: str = "matched"
    attention_implementation: str | None = None
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    qk_norm: bool = True
    rope: bool = True
    rope_theta: float = 10000.0
    mla_kv_lora_rank: int = 32
    mla_q_lora_rank: int | None = None
    mla_nope_dim: int = 16
    mla_rope_dim: int = 16
    mla_v_dim: int = 16
    # linear mixers
    linear_num_heads: int = 2
    linear_key_dim: int = 16
    linear_value_dim: int = 16
    mamba_head_dim: int = 16
    mamba_state_dim: int = 16
    mamba_expand: int = 2
    conv_width: int = 4
    mixer_impl: str = "chunked"
    chunk_size: int = 64
    kda_chunk_size: int = 32  # KDA's chunked form holds [C, C, K] pair decays
    state_pass: str = "auto"  # how the chunked form carries the state across chunks
    # GDN / KDA: the six projections of a mixer's input as one matmul, its three short
    # convolutions as one (the same parameters; values equal up to f32 sums' order; on
    # since it trained 569m 6.9% faster on the H200, docs/models.md)
    fused_projections: bool = True
    state_scan_unroll: int = 1  # the sequential state pass's lax.scan unroll
    # how GDN and Mamba-2 form each chunk's own operands: "xla" or "pallas" (one kernel per
    # direction; per-head decays only, so KDA keeps "xla")
    chunk_local: str = "xla"
    # precision scopes: "fp8" | "bf16" (attn_core also "f32" for the reference arm)
    ffn: str = "fp8"
    attn_proj: str | None = None
    attn_core: str | None = None
    fp8_scaling: str = "per_token"  # FP8 linear layers (ffn, attn_proj)
    # how the cudnn_bf16 arm hands packed documents to cuDNN: "packed" (its packed
    # sequences, the fast path) or "mask" (dense)
    cudnn_documents: str = "packed"
    # compilation and memory: scan over the repeating layer group; rematerialisation policy
    scan_layers: bool = True
    remat: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "pattern", tuple(self.pattern))
        bad = [k for k in self.pattern if k not in LAYER_KINDS]
        if not self.pattern or bad:
            raise ValueError(f"pattern: layer kinds must be in {LAYER_KINDS}, got {self.pattern}")
        check_arm(self.attention, self.attn_core)
        if self.attention_implementation not in (None,) + IMPLEMENTATIONS:
            raise ValueError(
                f"attention_implementation: must be None or one of {IMPLEMENTATIONS}, "
                f"got {self.attention_implementation!r}"
            )
        for name in ("ffn", "attn_proj"):
            val = getattr(self, name)
            if val not in ("fp8", "bf16") and not (name == "attn_proj" and val is None):
                raise ValueError(f"{name}: must be 'fp8' or 'bf16', got {val!r}")
        check_scaling(self.fp8_scaling)
        check_documents(self.cudnn_documents, "cudnn_documents")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat: must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
        if self.mixer_impl not in ("chunked", "naive"):
            raise ValueError(f"mixer_impl: must be 'chunked' or 'naive', got {self.mixer_impl!r}")
        check_state_pass(self.state_pass, self.state_scan_unroll, "state_scan_unroll")
        check_chunk_local_name(self.chunk_local)
        if "mamba2" in self.pattern and (self.mamba_expand * self.d_model) % self.mamba_head_dim:
            raise ValueError(
                f"mamba_head_dim: {self.mamba_head_dim} must divide mamba_expand * "
                f"d_model = {self.mamba_expand * self.d_model}"
            )
        if self.rope and (
            "attn" in self.pattern
            and self.head_dim % 2
            or "mla" in self.pattern
            and self.mla_rope_dim % 2
        ):
            raise ValueError("head_dim / mla_rope_dim: RoPE needs even widths")

    # -- derived switches ------------------------------------------------------------------
    @property
    def attention_layer_indices(self) -> tuple:
        """Indices (into `pattern`) of the softmax-attention layers."""
        return tuple(i for i, k in enumerate(self.pattern) if k in ATTENTION_KINDS)

    @property
    def layer_period(self) -> int:
        """Length of the shortest group whose repeats make up `pattern`."""
        n = len(self.pattern)
        return next(p for p in range(1, n + 1) if self.pattern == self.pattern[:p] * (n // p))

    @property
    def layer_repeats(self) -> int:
        """How many times the group of `layer_period` layers repeats."""
        return len(self.pattern) // self.layer_period

    @property
    def scans_layers(self) -> bool:
        """Whether the forward runs the repeats of the layer group as one `lax.scan`."""
        return self.scan_layers and self.layer_repeats > 1

    @property
    def attn_proj_fp8(self) -> bool:
        return (self.attn_proj or ("fp8" if self.attention in FP8_ARMS else "bf16")) == "fp8"

    @property
    def attn_core_precision(self) -> str:
        return self.attn_core or ARMS[self.attention].precisions[0]

    @property
    def mamba_num_heads(self) -> int:
        return self.mamba_expand * self.d_model // self.mamba_head_dim

    def state_passes(self, seq_len: int) -> dict:
        """{recurrent mixer kind: the state pass it runs at `seq_len` tokens} (what "auto"
        resolves to here, `dm_jax.nn.recurrence.resolve_state_pass`); {} for the naive form."""
        if self.mixer_impl != "chunked":
            return {}
        shapes = {  # chunk, key dim, value dim of each kind's recurrence
            "gdn": (self.chunk_size, self.linear_key_dim, self.linear_value_dim),
            "kda": (self.kda_chunk_size, self.linear_key_dim, self.linear_value_dim),
            "mamba2": (self.chunk_size, self.mamba_state_dim, self.mamba_head_dim),
        }
        return {
            kind: resolve_state_pass(self.state_pass, min(c, seq_len), k, v)
            for kind, (c, k, v) in shapes.items()
            if kind in self.pattern
        }

    # -- size and cost ---------------------------------------------------------------------
    def _mixer_counts(self, kind: str) -> tuple:
        """(matmul weights, other parameters) of one mixer of `kind`."""
        d, W = self.d_model, self.conv_width
        if kind == "attn":
            H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
            return 2 * d * H * D + 2 * d * Hkv * D, 2 * D * self.qk_norm
        if kind == "mla":
            H, dn, dr, dv = self.num_heads, self.mla_nope_dim, self.mla_rope_dim, self.mla_v_dim
            rq, rkv = self.mla_q_lora_rank, self.mla_kv_lora_rank
            q = d * rq + rq * H * (dn + dr) if rq else d * H * (dn + dr)
            mm = q + d * (rkv + dr) + rkv * H * (dn + dv) + H * dv * d
            return mm, (rq or 0) + rkv + 2 * (dn + dr) * self.qk_norm
        if kind == "mamba2":
            E, N, H = self.mamba_expand * d, self.mamba_state_dim, self.mamba_num_heads
            return d * (2 * E + 2 * N + H) + E * d, W * (E + 2 * N) + 3 * H + E
        H, K, V = self.linear_num_heads, self.linear_key_dim, self.linear_value_dim
        conv = W * (2 * H * K + H * V)
        if kind == "gdn":
            return d * (2 * H * K + 2 * H * V + 2 * H) + H * V * d, conv + 2 * H + V
        # kda: low-rank decay (d->K->H*K) and output gate (d->K->H*V)
        mm = d * (2 * H * K + H * V + H) + d * K + K * H * K + d * K + K * H * V + H * V * d
        return mm, conv + H + H * K + V

    def num_params(self) -> int:
        """Exact number of parameters of `HybridLM(self)` (embeddings and head included)."""
        d, V = self.d_model, self.vocab_size
        total = V * d * (1 if self.tie_embeddings else 2) + d  # embed, head, final norm
        for kind in self.pattern:
            mm, other = self._mixer_counts(kind)
            total += mm + other + 3 * d * self.mlp_hidden + 2 * d
        return total

    def flops_per_token(self, seq_len: int, *, training: bool = True) -> float:
        """Matmul FLOPs per token at context `seq_len` (training = forward + backward = 3x).

        Counts 2 FLOPs per multiply-add of every weight matmul (LM head included, embedding
        lookup excluded), the causal attention core (QK^T and PV over (seq_len + 1) / 2 keys on
        average), and the chunked linear recurrences (chunk size C, per token and head:
        2 (C (K + V) + 2 K V) for the intra-chunk scores, P U, q S and k^T U, plus
        2 (C K + K V) for the delta rule's A matrix and W S). Triangular solves, elementwise
        work and softmax are not counted.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        d, C = self.d_model, self.chunk_size
        fwd = 2.0 * d * self.vocab_size
        for kind in self.pattern:
            fwd += 2.0 * (self._mixer_counts(kind)[0] + 3 * d * self.mlp_hidden)
            if kind in ATTENTION_KINDS:
                dqk, dv = (
                    (self.head_dim, self.head_dim)
                    if kind == "attn"
                    else (self.mla_nope_dim + self.mla_rope_dim, self.mla_v_dim)
                )
                fwd += 2.0 * self.num_heads * (dqk + dv) * (seq_len + 1) / 2
            elif kind == "mamba2":
                H, K, V = self.mamba_num_heads, self.mamba_state_dim, self.mamba_head_dim
                fwd += 2.0 * H * (C * (K + V) + 2 * K * V)
            else:
                H, K, V = self.linear_num_heads, self.linear_key_dim, self.linear_value_dim
                fwd += 2.0 * H * (C * (2 * K + V) + 3 * K * V)
        return 3.0 * fwd if training else fwd
