"""Attention layers and cores: arm dispatch into dm_jax.attention, the Flax adapter, MLA
shapes, FP8 linear layers, and the cuDNN baselines' CPU behaviour."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dm_jax
import dm_jax.reference
from dm_jax import baselines
from dm_jax.nn import GQAttention, Linear, MLAttention, SwiGLU, dot_product_attention
from dm_jax.nn.fp8 import fp8_dot_count as f8_dots
from dm_jax.arms import DELTA_ARMS

core_module = importlib.import_module(
    "dm_jax.nn.attention_core"
)  # the package exports a function of that name


def _spy(calls):
    def fake(q, k, v, **kw):
        calls.append(kw)
        return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)

    return fake


@pytest.mark.parametrize("arm", DELTA_ARMS + ("bf16",))
def test_arm_reaches_dm_attention_with_its_delta(arm, monkeypatch):
    calls = []
    monkeypatch.setattr(core_module, "attention", _spy(calls))  # the op the core calls
    layer = GQAttention(
        32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        arm=arm,
        implementation="reference",
        rngs=nnx.Rngs(0),
    )
    seg = jnp.zeros((2, 8), jnp.int32)
    layer(jnp.ones((2, 8, 32)), segment_ids=seg)
    (kw,) = calls
    assert kw["delta"] == ("stale" if arm == "bf16" else arm)
    assert kw["precision"] == ("bf16" if arm == "bf16" else "fp8")
    assert kw["causal"] and kw["implementation"] == "reference"
    assert kw["segment_ids"] is seg


def test_reference_arm_uses_mha_reference_and_core_scope(monkeypatch):
    calls = []
    monkeypatch.setattr(dm_jax.reference, "mha_reference", _spy(calls))
    GQAttention(32, num_heads=2, num_kv_heads=2, head_dim=16, arm="reference", rngs=nnx.Rngs(0))(
        jnp.ones((1, 4, 32))
    )
    assert len(calls) == 1 and calls[0]["causal"]
    with pytest.raises(ValueError, match="attn_core"):
        GQAttention(
            32,
            num_heads=2,
            num_kv_heads=2,
            head_dim=16,
            arm="reference",
            core_precision="fp8",
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="attention"):
        GQAttention(32, num_heads=2, num_kv_heads=2, head_dim=16, arm="flash", rngs=nnx.Rngs(0))


def test_matched_arm_gradient_is_dm_attention_gradient():
    """Layer gradient w.r.t. the core inputs equals a direct dm_jax.attention VJP."""
    layer = GQAttention(
        32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        arm="matched",
        dtype=jnp.float32,
        rngs=nnx.Rngs(1),
    )
    x = jax.random.normal(jax.random.key(0), (1, 16, 32))
    cap = {}
    layer(x, capture=cap)
    do = jax.random.normal(jax.random.key(1), (1, 16, 4, 16))
    core = lambda q, k, v: dm_jax.attention(q, k, v, causal=True, delta="matched")
    want = jax.vjp(core, cap["q"], cap["k"], cap["v"])[1](do)
    got = jax.vjp(lambda q, k, v: layer.core(q, k, v), cap["q"], cap["k"], cap["v"])[1](do)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_mla_shapes_and_gains():
    layer = MLAttention(
        32,
        num_heads=2,
        kv_lora_rank=16,
        q_lora_rank=12,
        nope_dim=16,
        rope_dim=16,
        v_dim=16,
        arm="reference",
        rngs=nnx.Rngs(0),
    )
    cap = {}
    y = layer(jnp.ones((2, 5, 32)), capture=cap)
    assert y.shape == (2, 5, 32)
    assert cap["q"].shape == cap["k"].shape == (2, 5, 2, 32) and cap["v"].shape == (2, 5, 2, 16)
    assert layer.q_norm.scale.get_value().shape == (32,)  # gains over all Dqk channels


def test_flax_multihead_attention_adapter():
    kw = dict(
        num_heads=2,
        in_features=32,
        qkv_features=32,
        decode=False,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    ours = nnx.MultiHeadAttention(
        attention_fn=functools.partial(dot_product_attention, arm="reference"), **kw
    )
    kw["rngs"] = nnx.Rngs(0)
    theirs = nnx.MultiHeadAttention(**kw)
    x = jax.random.normal(jax.random.key(0), (2, 12, 32))
    want = theirs(x, mask=nnx.make_causal_mask(jnp.ones((2, 12))))
    np.testing.assert_allclose(ours(x, is_causal=True), want, atol=1e-5)
    fp8 = nnx.MultiHeadAttention(attention_fn=dot_product_attention, **dict(kw, rngs=nnx.Rngs(0)))
    np.testing.assert_allclose(fp8(x, is_causal=True), want, atol=0.1)
    with pytest.raises(ValueError, match="mask: .*is_causal=True"):
        ours(x, mask=nnx.make_causal_mask(jnp.ones((2, 12))))
    q = x.reshape(2, 12, 2, 16)
    with pytest.raises(TypeError, match=r"\['causal'\].*is_causal=True"):  # not dropped silently
        dot_product_attention(q, q, q, causal=True)


def test_fp8_linear_values_grads_and_jaxpr():
    x = jax.random.normal(jax.random.key(0), (6, 32))
    lin8 = Linear(32, 24, fp8=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    lin = Linear(32, 24, fp8=False, dtype=jnp.float32, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(lin8(x), lin(x), atol=0.1, rtol=0.1)
    g8 = jax.grad(lambda x: jnp.sum(lin8(x) ** 2))(x)
    g = jax.grad(lambda x: jnp.sum(lin(x) ** 2))(x)
    assert np.corrcoef(np.ravel(g8), np.ravel(g))[0, 1] > 0.99
    # forward: 1 FP8 dot; forward + backward: 3 (y = xW, dx = dy W^T, dW = x^T dy)
    assert f8_dots(jax.make_jaxpr(lin8)(x)) == 1
    assert f8_dots(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(lin8(x))))(x)) == 3
    assert f8_dots(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(lin(x))))(x)) == 0
    mlp = SwiGLU(32, 64, fp8=True, rngs=nnx.Rngs(0))
    assert f8_dots(jax.make_jaxpr(mlp)(x)) == 2


def test_cudnn_baselines_fail_clearly_on_cpu():
    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head dim 128"):
        baselines.cudnn_fp8_attention(q[..., :64], q[..., :64], q[..., :64], causal=True)
    with pytest.raises(NotImplementedError, match="segment_ids"):
        baselines.cudnn_fp8_attention(q, q, q, segment_ids=jnp.zeros((1, 128), jnp.int32))
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="GPU"):
            baselines.cudnn_fp8_attention(q, q, q, causal=True)
        with pytest.raises(RuntimeError, match="GPU"):
            baselines.cudnn_bf16_attention(q, q, q, causal=True)


def test_cudnn_fp8_params_complete_and_bounded():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    q = jax.random.normal(jax.random.key(0), (1, 256, 2, 128))
    s = baselines.current_scale(q)
    params = baselines._fp8_params(s, s, s)
    assert set(params) == set(fa.fp8_params_keys)
    assert all(p.shape == (1, 1, 1, 1) and p.dtype == jnp.float32 for p in params.values())
    np.testing.assert_allclose(params["descale_q"] * s, 1.0)
    assert float(jnp.max(jnp.abs(q)) * s) <= 448


def _fake_cudnn_fp8(q8, k8, v8, fp8_params=None, *, scale, mask_type, qkv_layout, use_fp8):
    """CPU stand-in with cuDNN FP8 semantics: descale inputs, scale the FP8 outputs."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    assert use_fp8 and qkv_layout == "BTNH" and q8.dtype == jnp.float8_e4m3fn
    causal = mask_type == fa.MaskType.CAUSAL
    real = lambda q, k, v: dm_jax.reference.mha_reference(q, k, v, causal=causal, scale=scale)
    f8 = lambda x, s: jnp.clip(x * s, -448, 448).astype(jnp.float8_e4m3fn)

    @jax.custom_vjp
    def run(q8, k8, v8, params):
        return run_fwd(q8, k8, v8, params)[0]

    def run_fwd(q8, k8, v8, params):
        p = {k: v.reshape(()) for k, v in params.items()}
        qkv = (
            q8.astype(jnp.float32) * p["descale_q"],
            k8.astype(jnp.float32) * p["descale_k"],
            v8.astype(jnp.float32) * p["descale_v"],
        )
        one = jnp.ones((1, 1, 1, 1), jnp.float32)
        o8 = f8(real(*qkv), p["scale_o"])
        return (o8, one, one), (qkv, o8, params)

    def run_bwd(res, g):
        """dS is formed, scaled and cast like cuDNN on the H200 (benchmarks/cudnn_fp8_probe.py):
        output scale keys rotated (scale_dQ -> dS, scale_dK -> dQ, scale_dV -> dK,
        scale_dP -> dV), descale_o and descale_dO swapped, dS times descale_s; dQ, dK come
        from the FP8 dS."""
        (q, k, v), o8, params = res
        p = {k: v.reshape(()) for k, v in params.items()}
        do = g[0].astype(jnp.float32)  # dO's descale ("descale_o", swapped) only enters dV
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        prob = jax.nn.softmax(s, axis=-1)
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, v)
        # delta from the FP8 output, descaled by "descale_dO" (swapped with descale_o)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o8.astype(jnp.float32) * p["descale_dO"])
        ds = prob * (dp - delta[..., None]) * p["descale_s"]
        ds_hat = f8(ds, p["scale_dQ"]).astype(jnp.float32) * p["descale_dP"]
        dq = scale * jnp.einsum("bhqk,bkhd->bqhd", ds_hat, k)
        dk = scale * jnp.einsum("bhqk,bqhd->bkhd", ds_hat, q)
        dv = jnp.einsum("bhqk,bqhd->bkhd", prob, do) * p["descale_o"]
        amax = lambda x: jnp.max(jnp.abs(x)).reshape(1, 1, 1, 1)
        dparams = {name: jnp.zeros_like(x) for name, x in params.items()}
        dparams.update(amax_dQ=amax(dq), amax_dK=amax(dk), amax_dV=amax(dv), amax_dP=amax(ds))
        return f8(dq, p["scale_dK"]), f8(dk, p["scale_dV"]), f8(dv, p["scale_dP"]), dparams

    run.defvjp(run_fwd, run_bwd)
    return run(q8, k8, v8, fp8_params)


@pytest.mark.parametrize("do_size", [1e-2, 30.0])
def test_cudnn_fp8_scaling_bookkeeping(monkeypatch, do_size):
    """With a stand-in kernel of cuDNN's measured FP8 semantics, outputs and gradients come
    back in real units (catches a missing descale, dO pre-scale, a dS left below E4M3's range,
    a dV scale on the wrong key: with dO scaled to +-448, dV = P^T dO^ would pass 448)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "dot_product_attention", _fake_cudnn_fp8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (1, 128, 2, 128)) for kk in ks[:3])
    k, v = k[:, :, :1], v[:, :, :1]  # GQA: 2 query heads share one kv head
    # same sign everywhere: dV_j = sum_i P_ij dO_i adds up (early keys collect ~5 rows)
    do = do_size * (1.0 + 0.2 * jax.random.normal(ks[3], (1, 128, 2, 128)))
    ref = lambda q, k, v: dm_jax.reference.mha_reference(q, k, v, causal=True)
    fp8 = lambda q, k, v: baselines.cudnn_fp8_attention(q, k, v, causal=True)
    o_ref, vjp_ref = jax.vjp(ref, q, k, v)
    o, vjp = jax.vjp(fp8, q, k, v)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(o, o_ref) < 0.1
    for g, g_ref in zip(vjp(do), vjp_ref(do)):
        assert g.shape == g_ref.shape and rel(g, g_ref) < 0.1


def test_packed_segments_give_each_documents_start_and_length():
    """cuDNN's packed sequences from segment ids: each row's documents (contiguous runs),
    their first tokens and lengths, -1 past the last; documents past max_segments dropped."""
    ids = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [5] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 1, 1] * 2])
    seqlen, offsets = baselines.packed_segments(ids, 4)
    assert seqlen.tolist() == [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 1], [2, 2, 2, 2]]
    assert offsets.tolist() == [
        [0, 3, 5, -1, -1],
        [0, -1, -1, -1, -1],
        [0, 1, 2, 3, -1],
        [0, 2, 4, 6, -1],
    ]
    with pytest.raises(ValueError, match="max_segments"):
        baselines.packed_segments(ids, 0)
    with pytest.raises(ValueError, match="one \\[B, T\\] array"):
        baselines.packed_segments(ids[0], 2)
    q = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="self-attention segment ids"):
        baselines.cudnn_bf16_attention(q, q, q, segment_ids=(ids, ids), max_segments=4)


def test_cudnn_documents_reach_the_cudnn_core_and_are_checked(monkeypatch):
    """`HybridConfig(cudnn_documents="packed")` (`--cudnn-documents packed`) sends the
    cudnn_bf16 arm's segment ids to `baselines.cudnn_bf16_documents`; "mask" and the other
    arms never call it; a bad mode is refused where it is given."""
    from dm_jax.models.config import HybridConfig
    from dm_jax.nn.attention_core import attention_core

    calls = []

    def documents(q, k, v, **kw):
        calls.append(kw["segment_ids"].shape)
        return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)

    monkeypatch.setattr(baselines, "cudnn_bf16_documents", documents)
    q = jnp.ones((2, 8, 2, 16), jnp.bfloat16)
    ids = jnp.array([[0] * 4 + [1] * 4] * 2)
    from dm_jax.models.hybrid import _make_mixer

    cfg = HybridConfig(attention="cudnn_bf16", cudnn_documents="packed")
    layer = _make_mixer("attn", cfg, jnp.bfloat16, nnx.Rngs(0))
    assert layer.cudnn_documents == "packed"
    layer(jnp.ones((2, 8, cfg.d_model), jnp.bfloat16), segment_ids=ids)
    assert calls == [(2, 8)]
    with pytest.raises(RuntimeError, match="GPU"):  # the dense-mask path: cuDNN itself
        attention_core(q, q, q, arm="cudnn_bf16", segment_ids=ids, documents="mask")
    attention_core(q, q, q, arm="bf16", segment_ids=ids, documents="packed")  # ignored
    assert calls == [(2, 8)]
    widths = []  # MLA: V narrower than Q/K goes in zero-padded, the output comes back cut
    monkeypatch.setattr(
        baselines,
        "cudnn_bf16_documents",
        lambda q, k, v, **kw: widths.append(v.shape[-1]) or jnp.ones(q.shape, q.dtype),
    )
    out = attention_core(q, q, q[..., :8], arm="cudnn_bf16", segment_ids=ids, documents="packed")
    assert widths == [16] and out.shape == (2, 8, 2, 8)
    with pytest.raises(ValueError, match="documents: must be one of"):
        attention_core(q, q, q, arm="cudnn_bf16", documents="dense")
    with pytest.raises(ValueError, match="cudnn_documents: must be one of"):
        HybridConfig(cudnn_documents="dense")
