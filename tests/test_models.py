"""HybridLM and presets: shapes, causality, packed documents, parameter counts, precision
scopes, training steps, QK gains, the attention probe and the ablation switch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dm_jax.models import FAMILIES, HybridConfig, HybridLM, attention_probe, preset, qk_gains
from dm_jax.nn.fp8 import fp8_dot_count as f8_dots

B, T = 2, 24


def _exact(family, **kw):
    """Tiny preset with every matmul in float32 (structure tests need exact math)."""
    return preset(family, attention="reference", compute_dtype="float32", ffn="bf16", **kw)


def _count(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_causality_packing_and_size(family):
    cfg = _exact(family)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    assert _count(model) == cfg.num_params()
    fwd = nnx.jit(lambda m, tok, seg: m(tok, segment_ids=seg))
    tok = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    zeros = jnp.zeros((B, T), jnp.int32)
    logits = fwd(model, tok, zeros)
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    # Causality: changing tokens after position t leaves logits up to t unchanged.
    t = 13
    other = tok.at[:, t + 1 :].set((tok[:, t + 1 :] + 7) % cfg.vocab_size)
    changed = fwd(model, other, zeros)
    np.testing.assert_allclose(changed[:, : t + 1], logits[:, : t + 1], atol=1e-5)
    assert float(jnp.abs(changed[:, t + 1 :] - logits[:, t + 1 :]).max()) > 1e-3
    # Packed documents: [A | D] gives D the logits of D run alone at the start of a row.
    a, d = tok[0, :10], tok[1, :14]
    packed = jnp.stack([jnp.concatenate([a, d]), jnp.concatenate([d, a])])
    seg = jnp.array([[0] * 10 + [1] * 14, [0] * 14 + [1] * 10], jnp.int32)
    out = fwd(model, packed, seg)
    np.testing.assert_allclose(out[0, 10:], out[1, :14], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_a_few_steps(family):
    # Default arm (matched), FP8 FFNs and attention projections; the last two layers of the
    # family's pattern (one mixer, one attention layer) keep the CPU compile short.
    cfg = preset(family)
    cfg = dataclasses.replace(cfg, pattern=cfg.pattern[-2:])
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tok = jax.random.randint(jax.random.key(2), (B, T + 1), 0, cfg.vocab_size)
    seg = jnp.array([[0] * 12 + [1] * 12, [0] * 24], jnp.int32)

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            logits = model(tok[:, :-1], segment_ids=seg)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
    for g_q, g_k in qk_gains(model).values():  # gains are trained
        assert float(jnp.abs(g_q - 1).max()) > 0 and float(jnp.abs(g_k - 1).max()) > 0


@pytest.mark.parametrize("size,target", [("569m", 569e6), ("1.67b", 1.67e9), ("5.29b", 5.29e9)])
def test_paper_scale_parameter_counts(size, target):
    for family in FAMILIES:
        cfg = preset(family, size)
        assert abs(cfg.num_params() / target - 1) < 0.03, (family, cfg.num_params())
        assert cfg.flops_per_token(8192) > cfg.flops_per_token(1024) > 6 * cfg.num_params() * 0.5
    head = 256 if size in ("569m", "5.29b") else 128
    assert preset("gdn_gqa", size).head_dim == head


def test_num_params_is_the_built_model_at_scale():
    cfg = preset("gdn_mla", "569m")
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert _count(abstract) == cfg.num_params()


def test_precision_scopes_change_dot_dtypes():
    tok = jnp.zeros((1, 16), jnp.int32)

    def dots(**kw):
        cfg = preset("gqa", pattern=("attn", "attn"), scan_layers=False, **kw)  # both layers
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        jaxpr = jax.make_jaxpr(lambda t: model(t))(tok)
        return f8_dots(jaxpr), str(jaxpr).count("f8_e4m3fn")

    assert dots(attention="reference", ffn="fp8")[0] == 2 * 2  # gate_up and down per layer
    assert dots(attention="reference", ffn="bf16") == (0, 0)
    assert dots(attention="reference", ffn="bf16", attn_proj="fp8")[0] == 4 * 2  # q, k, v, o
    core_fp8 = dots(attention="matched", ffn="bf16", attn_proj="bf16")
    assert core_fp8[0] == 0 and core_fp8[1] > 0  # FP8 operands only inside the core
    assert dots(attention="matched", ffn="bf16", attn_proj="bf16", attn_core="bf16") == (0, 0)
    # The FP8 arms quantize projections by default, the reference arm does not.
    assert preset("gdn_gqa").attn_proj_fp8 and not preset("gdn_gqa", attention="bf16").attn_proj_fp8


def test_attention_probe_gives_exact_core_inputs_and_do():
    cfg = _exact("gdn_gqa", pattern=("gdn", "attn", "gdn", "attn"))
    model = HybridLM(cfg, rngs=nnx.Rngs(3))
    tok = jax.random.randint(jax.random.key(4), (B, T), 0, cfg.vocab_size)
    tgt = jnp.roll(tok, -1, axis=1)
    probe = attention_probe(model, tok, tgt)
    assert sorted(probe) == [1, 3]
    D = cfg.head_dim
    p = probe[3]
    assert p["q"].shape == (B, T, 4, D) and p["k"].shape == (B, T, 2, D)
    assert p["do"].shape == (B, T, 4, D)
    # dO against a central finite difference along a random direction.
    r = jax.random.normal(jax.random.key(5), p["do"].shape)

    @jax.jit
    def loss(eps):
        logits = model(tok, core_probes={3: eps * r})
        return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

    eps = 1e-2
    fd = (loss(eps) - loss(-eps)) / (2 * eps)
    np.testing.assert_allclose(fd, jnp.sum(p["do"] * r), rtol=2e-3)
    assert float(jnp.abs(probe[1]["do"]).max()) > 0


def test_ablation_qk_gains_and_config_errors():
    cfg = _exact("gdn_gqa")
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    tok = jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8)
    (i,) = cfg.attention_layer_indices
    fwd = nnx.jit(lambda m, t, ablate: m(t, ablate_attention_layers=ablate), static_argnums=2)
    base, ablated = fwd(model, tok, ()), fwd(model, tok, (i,))
    assert float(jnp.abs(base - ablated).max()) > 1e-4
    with pytest.raises(ValueError, match="ablate_attention_layers"):
        fwd(model, tok, (0,))
    gains = qk_gains(model)
    assert list(gains) == [i] and gains[i][0].shape == (cfg.head_dim,)
    model.layers[i].mixer.k_norm.scale.set_value(jnp.full((cfg.head_dim,), 2.0))
    np.testing.assert_array_equal(qk_gains(model)[i][1], 2.0)
    assert qk_gains(HybridLM(dataclasses.replace(cfg, qk_norm=False), rngs=nnx.Rngs(0))) == {}
    with pytest.raises(ValueError, match="pattern"):
        HybridConfig(pattern=("gdn", "lstm"))
    with pytest.raises(ValueError, match="overrides"):
        preset("gdn_gqa", heads=3)
    with pytest.raises(ValueError, match="family"):
        preset("rwkv")
    with pytest.raises(ValueError, match="tokens_BT"):
        fwd(model, jnp.zeros((2, 8)), ())
    # Arms and precision scopes do not change the initial weights (paired runs).
    same = [
        nnx.state(HybridLM(preset("gdn_mla", attention=a, ffn=f), rngs=nnx.Rngs(0)))
        for a, f in (("matched", "fp8"), ("reference", "bf16"))
    ]
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(same[0]), jax.tree.leaves(same[1]))
    )
    wide = preset("gdn_gqa", "1.67b", head_dim=256)
    assert wide.num_heads * wide.head_dim == 16 * 128 and not preset("gdn_gqa", rope=False).rope


def test_layers_are_flax_layers_and_init_is_unchanged():
    """Embedding, linear layers and norms are nnx.Embed / nnx.Linear / nnx.RMSNorm (so the
    optimizer routes them by structure); parameters are drawn as before they were."""
    from dm_jax.nn import Linear, RMSNorm
    from train import optim

    cfg = preset("gdn_gqa", vocab_size=320)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model.embed, nnx.Embed) and isinstance(model.head, nnx.Linear)
    assert isinstance(model.layers[3].mixer.q_norm, nnx.RMSNorm)
    first_key = nnx.Rngs(0).params()  # the embedding still takes the first key, N(0, 1)
    np.testing.assert_array_equal(
        model.embed.embedding.get_value(),
        jax.random.normal(first_key, (320, cfg.d_model), jnp.float32),
    )
    lin = Linear(64, 32, rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(
        lin.kernel.get_value(), 64**-0.5 * jax.random.normal(nnx.Rngs(3).params(), (64, 32))
    )
    x = jax.random.normal(jax.random.key(0), (2, 5, 64))
    want = jnp.einsum(
        "btk,kn->btn",
        x.astype(jnp.bfloat16),
        lin.kernel.get_value().astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    ).astype(jnp.bfloat16)
    np.testing.assert_array_equal(lin(x), want)
    assert Linear(64, 32, fp8=True, rngs=nnx.Rngs(3))(x).dtype == jnp.bfloat16
    assert f8_dots(jax.make_jaxpr(lambda x: Linear(64, 32, fp8=True, rngs=nnx.Rngs(3))(x))(x)) == 1
    norm = RMSNorm(8)
    y = norm(jnp.arange(16, dtype=jnp.bfloat16).reshape(2, 8))
    assert y.dtype == jnp.bfloat16 and norm.scale.get_value().shape == (8,)
    # Muon routing by structure: the embedding goes to AdamW because it is an nnx.Embed.
    params = nnx.state(model, nnx.Param)
    mask = optim.hidden_matrix_mask(model, params, vocab_size=10**9)  # vocab test switched off
    hidden = {jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(mask) if m}
    assert not any("embed" in k for k in hidden) and any("q_proj" in k for k in hidden)
    assert qk_gains(model)[3][0].shape == (cfg.head_dim,)
