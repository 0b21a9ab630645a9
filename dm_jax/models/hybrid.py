"""`HybridLM`: a causal language model interleaving linear-recurrent mixers with softmax
attention, plus the helpers the training and experiment code use to look inside it:
`qk_gains` (QK-norm channel gains) and `attention_probe` (exact core inputs and dO).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dm_jax.models.config import REMAT_POLICIES, HybridConfig
from dm_jax.nn.attention import GQAttention, MLAttention
from dm_jax.nn.fp8 import Linear, RMSNorm
from dm_jax.nn.gated_deltanet import GatedDeltaNet
from dm_jax.nn.kda import KimiDeltaAttention
from dm_jax.nn.mamba2 import Mamba2
from dm_jax.nn.mlp import SwiGLU


def _make_mixer(kind: str, cfg: HybridConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
    d = cfg.d_model
    recurrent = dict(  # every recurrent mixer: its recurrence's form, dtype, rngs
        conv_width=cfg.conv_width,
        impl=cfg.mixer_impl,
        chunk_size=cfg.chunk_size,
        state_pass=cfg.state_pass,
        scan_unroll=cfg.state_scan_unroll,
        dtype=dtype,
        rngs=rngs,
    )
    linear = dict(
        recurrent,
        num_heads=cfg.linear_num_heads,
        key_dim=cfg.linear_key_dim,
        value_dim=cfg.linear_value_dim,
    )
    attn = dict(
        qk_norm=cfg.qk_norm,
        rope=cfg.rope,
        rope_theta=cfg.rope_theta,
        arm=cfg.attention,
        implementation=cfg.attention_implementation,
        core_precision=cfg.attn_core_precision,
        cudnn_documents=cfg.cudnn_documents,
        proj_fp8=cfg.attn_proj_fp8,
        fp8_scaling=cfg.fp8_scaling,
        dtype=dtype,
        rngs=rngs,
    )
    per_head_decay = dict(chunk_local=cfg.chunk_local)  # KDA's per-channel decay: XLA's form
    builders = {
        "gdn": lambda: GatedDeltaNet(
            d, **linear, **per_head_decay, fused_projections=cfg.fused_projections
        ),
        "kda": lambda: KimiDeltaAttention(
            d,
            **dict(linear, chunk_size=cfg.kda_chunk_size),
            fused_projections=cfg.fused_projections,
        ),
        "mamba2": lambda: Mamba2(
            d,
            head_dim=cfg.mamba_head_dim,
            state_dim=cfg.mamba_state_dim,
            expand=cfg.mamba_expand,
            **recurrent,
            **per_head_decay,
        ),
        "attn": lambda: GQAttention(
            d, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, **attn
        ),
        "mla": lambda: MLAttention(
            d,
            num_heads=cfg.num_heads,
            kv_lora_rank=cfg.mla_kv_lora_rank,
            q_lora_rank=cfg.mla_q_lora_rank,
            nope_dim=cfg.mla_nope_dim,
            rope_dim=cfg.mla_rope_dim,
            v_dim=cfg.mla_v_dim,
            **attn,
        ),
    }
    return builders[kind]()


class Block(nnx.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += SwiGLU(norm(x)).

    Named scopes (`<kind>/norm`, `<kind>/mixer`, `<kind>/ffn`) label its operations in
    compiled programs and profiles (`train.profile_step`)."""

    def __init__(self, kind: str, cfg: HybridConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.compute_dtype)
        self.kind = kind
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = _make_mixer(kind, cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(
            cfg.d_model,
            cfg.mlp_hidden,
            fp8=cfg.ffn == "fp8",
            fp8_scaling=cfg.fp8_scaling,
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x_BTD, *, segment_ids=None, ablate=False, probe=None, capture=None):
        with jax.named_scope(self.kind):
            if not ablate:
                with jax.named_scope("norm"):
                    h = self.mixer_norm(x_BTD)
                with jax.named_scope("mixer"):
                    if self.kind in ("attn", "mla"):
                        h = self.mixer(h, segment_ids=segment_ids, probe=probe, capture=capture)
                    else:
                        h = self.mixer(h, segment_ids=segment_ids)
                x_BTD = x_BTD + h.astype(x_BTD.dtype)
            with jax.named_scope("norm"):
                h = self.mlp_norm(x_BTD)
            with jax.named_scope("ffn"):
                return x_BTD + self.mlp(h).astype(x_BTD.dtype)


def _scan_blocks(blocks, period: int, x_BTD, segment_ids, remat_policy):
    """`x = block(x)` for every block in order, as one `lax.scan` over the repeats of the
    layer group `blocks[:period]`: XLA compiles the group once instead of every layer.

    The layers keep their own parameters (the model's tree, its checkpoints and its
    optimizer routing are those of the unscanned model); each step stacks them along a new
    leading axis, [len(blocks) // period, ...] per group position, and the gradients are
    sliced back out. `remat_policy`: None (keep what the backward needs) or a
    `jax.checkpoint` policy for the group.
    """
    defs, stacked = [], []
    for j in range(period):
        splits = [nnx.split(block) for block in blocks[j::period]]
        defs.append(splits[0][0])
        stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in splits]))

    def group(x, states):
        for graphdef, state in zip(defs, states):
            x = nnx.merge(graphdef, state)(x, segment_ids=segment_ids)
        return x, None

    if remat_policy is not None:  # inside a scan XLA cannot merge the recomputation away
        group = jax.checkpoint(group, policy=remat_policy, prevent_cse=False)
    return jax.lax.scan(group, x_BTD, tuple(stacked))[0]


class HybridLM(nnx.Module):
    """Causal LM: tokens_BT (int) -> logits_BTV (float32).

    `HybridLM(config, rngs=nnx.Rngs(0))`; see `HybridConfig` for the layer kinds.
    """

    def __init__(self, config: HybridConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config: expected a HybridConfig, got {type(config).__name__}")
        self.config = config
        d, V = config.d_model, config.vocab_size
        self.dtype = jnp.dtype(config.compute_dtype)
        self.embed = nnx.Embed(V, d, embedding_init=jax.nn.initializers.normal(1.0), rngs=rngs)
        self.layers = nnx.List([Block(kind, config, rngs=rngs) for kind in config.pattern])
        self.final_norm = RMSNorm(d, eps=config.norm_eps)
        # untied: FP32 logits from FP32 sums, as the tied embedding's einsum gives them
        self.head = (
            None
            if config.tie_embeddings
            else Linear(d, V, dtype=self.dtype, out_dtype=jnp.float32, rngs=rngs)
        )

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        ablate_attention_layers=(),
        core_probes=None,
        capture=None,
    ) -> jax.Array:
        """Returns float32 logits [B, T, vocab_size].

        segment_ids: int [B, T] document ids of packed sequences: attention stays within a
          document, RoPE positions restart at each document, recurrent states, and short
          convolutions reset at document starts.
        ablate_attention_layers: layer indices whose mixer output is replaced by zeros.
        core_probes / capture: used by `attention_probe` ({layer: probe_BTHV} added to the
          attention-core output; {layer: {}} filled with the core's q, k, v).
        """
        if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
            raise ValueError(
                f"tokens_BT: expected int [B, T], got {tokens_BT.dtype} {tokens_BT.shape}"
            )
        if segment_ids is not None and segment_ids.shape != tokens_BT.shape:
            raise ValueError(f"segment_ids: expected {tokens_BT.shape}, got {segment_ids.shape}")
        bad = set(ablate_attention_layers) - set(self.config.attention_layer_indices)
        if bad:
            raise ValueError(
                f"ablate_attention_layers: {sorted(bad)} are not attention layers "
                f"{self.config.attention_layer_indices}"
            )
        core_probes, capture = core_probes or {}, capture or {}
        with jax.named_scope("embed"):
            x = self.embed(tokens_BT).astype(self.dtype)  # gathered in FP32, then cast
        cfg, policy = self.config, REMAT_POLICIES[self.config.remat]
        per_layer = bool(ablate_attention_layers or core_probes or capture)
        if cfg.scans_layers and not per_layer:
            x = _scan_blocks(self.layers, cfg.layer_period, x, segment_ids, policy)
        else:  # one call per layer (and the per-layer probes, captures and ablations)
            for i, layer in enumerate(self.layers):
                call = functools.partial(
                    layer,
                    segment_ids=segment_ids,
                    ablate=i in ablate_attention_layers,
                    probe=core_probes.get(i),
                    capture=capture.get(i),
                )
                if policy is not None and not per_layer:
                    call = jax.checkpoint(call, policy=policy)  # outside a scan: keep CSE off
                x = call(x)
        with jax.named_scope("norm"):
            x = self.final_norm(x)
        with jax.named_scope("head"):
            if self.head is None:
                emb = self.embed.embedding.get_value().astype(self.dtype)
                logits = jnp.einsum("btd,vd->btv", x, emb, preferred_element_type=jnp.float32)
            else:
                logits = self.head(x)
            return logits.astype(jnp.float32)


def qk_gains(model: HybridLM) -> dict:
    """{layer index: (g_q [Dqk], g_k [Dqk])} for every attention layer with QK-norm."""
    out = {}
    for i in model.config.attention_layer_indices:
        mixer = model.layers[i].mixer
        if mixer.q_norm is not None:
            out[i] = (mixer.q_norm.scale.get_value(), mixer.k_norm.scale.get_value())
    return out


def _core_out_shape(cfg: HybridConfig, i: int, B: int, T: int) -> tuple:
    dv = cfg.head_dim if cfg.pattern[i] == "attn" else cfg.mla_v_dim
    return (B, T, cfg.num_heads, dv)


def attention_probe(model: HybridLM, tokens_BT, targets_BT, *, segment_ids=None) -> dict:
    """Exact attention-core operands and output gradients of every attention layer.

    Returns {layer: {"q": [B,T,Hq,Dqk], "k": [B,T,Hkv,Dqk], "v": [B,T,Hkv,Dv],
    "do": [B,T,Hq,Dv] float32}} where do = d loss / d core output for
    loss = mean next-token cross-entropy of logits(tokens_BT) against targets_BT.
    dO is the gradient w.r.t. a zero probe added to the core output. Jitted (nnx.jit).
    """
    B, T = tokens_BT.shape
    if targets_BT.shape != (B, T):
        raise ValueError(f"targets_BT: expected {(B, T)}, got {targets_BT.shape}")
    return _probe(model, tokens_BT, targets_BT, segment_ids)


@nnx.jit
def _probe(model, tokens_BT, targets_BT, segment_ids):
    cfg = model.config
    B, T = tokens_BT.shape
    idx = cfg.attention_layer_indices
    probes = {i: jnp.zeros(_core_out_shape(cfg, i, B, T), jnp.float32) for i in idx}

    def loss_fn(probes):
        capture = {i: {} for i in idx}
        logits = model(tokens_BT, segment_ids=segment_ids, core_probes=probes, capture=capture)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT).mean()
        return loss, capture

    (_, capture), grads = jax.value_and_grad(loss_fn, has_aux=True)(probes)
    return {i: {**capture[i], "do": grads[i]} for i in idx}
