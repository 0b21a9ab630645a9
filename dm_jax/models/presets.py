"""Named model presets: `preset(family, size="tiny", **overrides) -> HybridConfig`.

Families (layer pattern, repeated):
  gdn_gqa     3 Gated DeltaNet : 1 GQA   (the paper's default hybrid)
  mamba2_gqa  3 Mamba-2 : 1 GQA
  kda_gqa     3 Kimi Delta Attention : 1 GQA
  gdn_mla     3 Gated DeltaNet : 1 MLA
  gqa         GQA only
Sizes:
  tiny        CI: d_model 64, 4 layers, byte vocabulary; seconds on a CPU
  small       one H200, minutes: d_model 512, 8 layers, head dim 128, byte vocabulary
  569m, 1.67b, 5.29b   the paper's scales, vocabulary 131072 (untied embeddings). The
              width, depth and heads are fixed per size; the SwiGLU width is then solved
              (rounded to a multiple of 128) so that `num_params()` matches the name for
              every family (within 1%). Head dim 256 at 569m and 5.29b, 128 at 1.67b.

Overrides are `HybridConfig` fields (`attention=`, `qk_norm=`, `rope=`, `head_dim=`, `ffn=`,
`attn_proj=`, `attn_core=`, `vocab_size=`, ...), applied after the MLP width is solved,
so a variant changes only what it names. `head_dim=` alone keeps the attention width
(num_heads * head_dim) and the query/kv head ratio, as in the paper's head-dim study.
"""

from __future__ import annotations

import dataclasses

from dm_jax.models.config import HybridConfig

FAMILIES = ("gdn_gqa", "mamba2_gqa", "kda_gqa", "gdn_mla", "gqa")
SIZES = ("tiny", "small", "569m", "1.67b", "5.29b")

_GROUP = {
    "gdn_gqa": ("gdn", "gdn", "gdn", "attn"),
    "mamba2_gqa": ("mamba2",) * 3 + ("attn",),
    "kda_gqa": ("kda",) * 3 + ("attn",),
    "gdn_mla": ("gdn", "gdn", "gdn", "mla"),
    "gqa": ("attn",) * 4,
}

# Per size: (groups of 4 layers, base fields). Target parameter count (None: fixed MLP).
_SIZES = {
    "tiny": (
        1,
        None,
        dict(vocab_size=256, d_model=64, mlp_hidden=128, chunk_size=16, kda_chunk_size=16),
    ),
    "small": (
        2,
        None,
        dict(
            vocab_size=256,
            d_model=512,
            mlp_hidden=1536,
            num_heads=4,
            num_kv_heads=2,
            head_dim=128,
            linear_num_heads=4,
            linear_key_dim=128,
            linear_value_dim=128,
            mamba_head_dim=64,
            mamba_state_dim=64,
            mla_kv_lora_rank=256,
            mla_nope_dim=128,
            mla_rope_dim=64,
            mla_v_dim=128,
        ),
    ),
    "569m": (
        6,
        569e6,
        dict(
            vocab_size=131072,
            d_model=1024,
            num_heads=4,
            num_kv_heads=2,
            head_dim=256,
            linear_num_heads=8,
            linear_key_dim=128,
            linear_value_dim=128,
            mamba_head_dim=64,
            mamba_state_dim=128,
            mla_kv_lora_rank=512,
            mla_q_lora_rank=768,
            mla_nope_dim=128,
            mla_rope_dim=64,
            mla_v_dim=128,
        ),
    ),
    "1.67b": (
        6,
        1.67e9,
        dict(
            vocab_size=131072,
            d_model=2048,
            num_heads=16,
            num_kv_heads=4,
            head_dim=128,
            linear_num_heads=16,
            linear_key_dim=128,
            linear_value_dim=128,
            mamba_head_dim=64,
            mamba_state_dim=128,
            mla_kv_lora_rank=512,
            mla_q_lora_rank=1536,
            mla_nope_dim=128,
            mla_rope_dim=64,
            mla_v_dim=128,
        ),
    ),
    "5.29b": (
        9,
        5.29e9,
        dict(
            vocab_size=131072,
            d_model=3072,
            num_heads=12,
            num_kv_heads=4,
            head_dim=256,
            linear_num_heads=24,
            linear_key_dim=128,
            linear_value_dim=128,
            mamba_head_dim=64,
            mamba_state_dim=128,
            mla_kv_lora_rank=512,
            mla_q_lora_rank=1536,
            mla_nope_dim=128,
            mla_rope_dim=64,
            mla_v_dim=128,
        ),
    ),
}
# MLA layers use d_model / mla_v_dim heads at the paper scales (value width = d_model).
_MLA_HEADS = {"small": 4, "569m": 8, "1.67b": 16, "5.29b": 24}


def _solve_mlp(cfg: HybridConfig, target: float) -> HybridConfig:
    """The SwiGLU width (multiple of 128) that brings num_params() closest to `target`."""
    without = dataclasses.replace(cfg, mlp_hidden=0).num_params()
    per_unit = 3 * cfg.d_model * len(cfg.pattern)
    hidden = max(128, 128 * round((target - without) / per_unit / 128))
    return dataclasses.replace(cfg, mlp_hidden=hidden)


def _keep_attention_width(base: HybridConfig, head_dim: int) -> dict:
    width, ratio = base.num_heads * base.head_dim, base.num_heads // base.num_kv_heads
    if width % head_dim:
        raise ValueError(
            f"head_dim: {head_dim} must divide the attention width {width} "
            f"(or pass num_heads= as well)"
        )
    heads = width // head_dim
    kv = heads // ratio if heads % ratio == 0 and heads >= ratio else 1
    return dict(num_heads=heads, num_kv_heads=kv)


def preset(family: str = "gdn_gqa", size: str = "tiny", **overrides) -> HybridConfig:
    """The named configuration; see the module docstring for families, sizes, overrides."""
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size: must be one of {SIZES}, got {size!r}")
    fields = {f.name for f in dataclasses.fields(HybridConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"overrides: unknown HybridConfig fields {unknown}")
    groups, target, base = _SIZES[size]
    base = dict(base, pattern=_GROUP[family] * groups)
    if family == "gdn_mla" and size in _MLA_HEADS:
        base.update(num_heads=_MLA_HEADS[size], num_kv_heads=_MLA_HEADS[size])
    cfg = HybridConfig(**base)
    if target is not None:
        cfg = _solve_mlp(cfg, target)
    if "head_dim" in overrides and "num_heads" not in overrides and family != "gdn_mla":
        overrides = {**_keep_attention_width(cfg, overrides["head_dim"]), **overrides}
    return dataclasses.replace(cfg, **overrides)
