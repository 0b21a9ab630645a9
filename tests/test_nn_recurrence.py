"""Linear-recurrent mixers: chunked form == naive recurrence (values and gradients), for the
shared recurrence and for each mixer layer (Gated DeltaNet, Mamba-2, KDA), with each state
pass across chunks (sequential scan, unrolled or not, the associative scan and the Pallas
kernels, in interpret mode)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dm_jax.nn import GatedDeltaNet, KimiDeltaAttention, Mamba2
from dm_jax.nn.recurrence import recurrent_chunked, recurrent_naive

B, T, H, K, V = 2, 37, 2, 8, 6  # T not a multiple of the chunk: exercises padding


def _inputs(seed, G):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, G)))
    b = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    seg = jnp.cumsum(jax.random.bernoulli(ks[5], 0.08, (B, T)), axis=1).astype(jnp.int32)
    return q, k, v, g, b, seg


# (delta rule, decay width, packed): GDN (delta, per head), KDA (delta, per channel),
# Mamba-2 (plain, per head), the plain rule with a per-channel decay; packed rows carry
# document boundaries and start from a non-zero state, unpacked ones from zero.
CASES = {
    "gdn": (True, 1, True),
    "kda": (True, K, True),
    "mamba2": (False, 1, True),
    "plain_per_channel": (False, K, True),
    "kda_unpacked": (True, K, False),
}


# schedules other than the default sequential scan and blocked inverse:
# (state_pass, scan_unroll, the delta rule's triangular solve)
PASSES = {
    "associative": ("associative", 1, "blocks"),
    "unroll3": ("sequential", 3, "blocks"),
    "pallas": ("pallas", 1, "blocks"),
    "doubling": ("sequential", 1, "doubling"),
}


@pytest.mark.parametrize("delta_rule,G,packed", CASES.values(), ids=CASES.keys())
def test_chunked_equals_naive_values_and_grads(delta_rule, G, packed):
    """The chunked form with every state pass gives the naive recurrence's outputs, final
    state and gradients (inputs and initial state), and so does the sequential pass, with T
    not a multiple of the chunk and (packed) a document starting exactly on a chunk border."""
    q, k, v, g, b, seg = _inputs(0, G)
    seg = seg + (jnp.arange(T) >= 16) if packed else None  # 16: the third chunk's first step
    ks = jax.random.split(jax.random.key(7), 3)
    w = jax.random.normal(ks[0], (B, T, H, V))
    ws = jax.random.normal(ks[1], (B, H, K, V))
    S0 = jax.random.normal(ks[2], (B, H, K, V)) if packed else None

    def grads(fn):
        def loss(args):
            o, S = fn(*args[:5], delta_rule=delta_rule, segment_ids=seg, initial_state_BHKV=args[5])
            return jnp.sum(o * w) + jnp.sum(S * ws), (o, S)

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))((q, k, v, g, b, S0))
        return out, grad

    def chunked(state_pass, unroll, solve="blocks"):
        kw = dict(chunk_size=8, state_pass=state_pass, scan_unroll=unroll, solve=solve)
        return lambda *a, **kw2: recurrent_chunked(*a, **kw, **kw2)

    naive = grads(recurrent_naive)
    sequential = grads(chunked("sequential", 1))
    chex.assert_trees_all_close(sequential[0], naive[0], atol=2e-5, rtol=2e-5)
    chex.assert_trees_all_close(sequential[1], naive[1], atol=5e-5, rtol=5e-5)
    for name, schedule in PASSES.items():
        out, grad = grads(chunked(*schedule))
        for want in (sequential, naive):
            chex.assert_trees_all_close(out, want[0], atol=2e-5, rtol=2e-5, custom_message=name)
            chex.assert_trees_all_close(grad, want[1], atol=5e-5, rtol=5e-5, custom_message=name)


def test_state_pass_arguments_are_checked():
    from dm_jax.models import HybridConfig
    from dm_jax.nn.recurrence import run_recurrence

    q, k, v, g, b, _ = _inputs(0, 1)
    with pytest.raises(ValueError, match="state_pass"):
        recurrent_chunked(q, k, v, g, b, delta_rule=True, state_pass="parallel")
    with pytest.raises(ValueError, match="solve"):
        recurrent_chunked(q, k, v, g, b, delta_rule=True, solve="qr")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="scan_unroll"):
            run_recurrence(q, k, v, g, b, delta_rule=True, impl="naive", scan_unroll=bad)
    with pytest.raises(ValueError, match="state_pass"):
        GatedDeltaNet(24, num_heads=2, key_dim=8, value_dim=8, state_pass="x", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="state_pass"):
        HybridConfig(state_pass="assoc")
    with pytest.raises(ValueError, match="state_scan_unroll"):
        HybridConfig(state_scan_unroll=0)


def test_config_state_pass_reaches_every_recurrent_mixer():
    from dm_jax.models import HybridLM, preset

    for family in ("gdn_gqa", "mamba2_gqa", "kda_gqa"):
        cfg = preset(family, "tiny", state_pass="associative", state_scan_unroll=4)
        mixers = [
            m
            for _, m in nnx.iter_graph(HybridLM(cfg, rngs=nnx.Rngs(0)))
            if isinstance(m, (GatedDeltaNet, Mamba2))
        ]
        assert mixers and all(
            (m.state_pass, m.scan_unroll) == ("associative", 4) for m in mixers
        ), family


def test_segments_reset_state():
    """A packed row equals its documents run separately (state does not cross documents)."""
    q, k, v, g, b, _ = _inputs(3, 1)
    cut = 15
    seg = jnp.broadcast_to((jnp.arange(T) >= cut).astype(jnp.int32), (B, T))
    o, _ = recurrent_naive(q, k, v, g, b, delta_rule=True, segment_ids=seg)
    second, _ = recurrent_naive(*(x[:, cut:] for x in (q, k, v, g, b)), delta_rule=True)
    np.testing.assert_allclose(o[:, cut:], second, atol=1e-5)
    with pytest.raises(ValueError, match="log_decay"):
        recurrent_naive(q, k, v, g[..., :1, :], b, delta_rule=True)


def _gdn(impl, rngs):
    return GatedDeltaNet(
        24,
        num_heads=2,
        key_dim=8,
        value_dim=8,
        impl=impl,
        chunk_size=8,
        dtype=jnp.float32,
        rngs=rngs,
    )


def _kda(impl, rngs):
    return KimiDeltaAttention(
        24,
        num_heads=2,
        key_dim=8,
        value_dim=8,
        impl=impl,
        chunk_size=8,
        dtype=jnp.float32,
        rngs=rngs,
    )


def _mamba(impl, rngs):
    return Mamba2(
        24, head_dim=8, state_dim=8, impl=impl, chunk_size=8, dtype=jnp.float32, rngs=rngs
    )


@pytest.mark.parametrize("make", [_gdn, _mamba, _kda], ids=["gdn", "mamba2", "kda"])
def test_mixer_layer_chunked_equals_naive(make):
    """Each layer gives the same output with either form and either state pass (the
    gradients of the three rules are compared above, on the recurrence the layers call)."""
    naive, chunked = make("naive", nnx.Rngs(0)), make("chunked", nnx.Rngs(0))
    associative = make("chunked", nnx.Rngs(0))
    associative.state_pass = "associative"
    x = jax.random.normal(jax.random.key(4), (2, 21, 24))
    seg = jnp.array([[0] * 9 + [1] * 12, [0] * 21], jnp.int32)
    fwd = nnx.jit(lambda m, x: m(x, segment_ids=seg))
    y1, y2, y3 = fwd(naive, x), fwd(chunked, x), fwd(associative, x)
    np.testing.assert_allclose(y1, y2, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(y1, y3, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(y1).max()) > 1e-3


@pytest.mark.parametrize("inverse", ["blocks", "doubling"])
@pytest.mark.parametrize("C", [1, 5, 16, 64])
def test_unit_lower_inverse_matches_triangular_solve(C, inverse):
    from jax.scipy.linalg import solve_triangular

    from dm_jax.nn.recurrence import unit_lower_inverse, unit_lower_inverse_doubling

    fn = unit_lower_inverse if inverse == "blocks" else unit_lower_inverse_doubling
    L = jnp.tril(jax.random.normal(jax.random.PRNGKey(C), (2, C, C)) * 0.3, -1) + jnp.eye(C)
    want = solve_triangular(
        L, jnp.broadcast_to(jnp.eye(C), L.shape), lower=True, unit_diagonal=True
    )
    np.testing.assert_allclose(fn(L), want, atol=1e-5)


@pytest.mark.parametrize("make", [_gdn, _kda], ids=["gdn", "kda"])
def test_fused_projections_keep_the_values_and_gradients(make):
    """`fused_projections`: the mixer's six projections of x as one matmul and its three
    short convolutions as one give the unfused layer's output and parameter gradients (bf16
    projections, segment ids), with the same parameters, to bf16 rounding (compiled, XLA
    may round the joined and the separate backward matmuls' bf16 results apart)."""
    kw = dict(num_heads=2, key_dim=8, value_dim=8, chunk_size=8, dtype=jnp.bfloat16)
    cls = GatedDeltaNet if make is _gdn else KimiDeltaAttention
    plain = cls(24, **kw, rngs=nnx.Rngs(0))
    fused = cls(24, **kw, fused_projections=True, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(plain, nnx.Param), nnx.state(fused, nnx.Param))
    x = jax.random.normal(jax.random.key(5), (2, 21, 24), jnp.bfloat16)
    seg = jnp.array([[0] * 9 + [1] * 12, [0] * 21], jnp.int32)

    def loss(m, x):
        return jnp.sum(m(x, segment_ids=seg).astype(jnp.float32) ** 2)

    grad = nnx.jit(nnx.value_and_grad(loss))
    (l1, g1), (l2, g2) = grad(plain, x), grad(fused, x)
    np.testing.assert_allclose(l1, l2, rtol=1e-2)
    assert float(l1) > 1e-3
    for (path, a), (_, b) in zip(jax.tree.leaves_with_path(g1), jax.tree.leaves_with_path(g2)):
        scale = float(jnp.abs(a).max())
        assert scale > 0, path
        np.testing.assert_allclose(a / scale, b / scale, atol=1e-2, err_msg=str(path))


def test_fused_linear_refuses_layers_it_cannot_join():
    from dm_jax.nn.fp8 import Linear, fused_linear

    rngs = nnx.Rngs(0)
    a, b = Linear(8, 4, rngs=rngs), Linear(8, 6, rngs=rngs)
    x = jax.random.normal(jax.random.key(0), (3, 8))
    ya, yb = fused_linear(x, [a, b])
    np.testing.assert_array_equal(ya, a(x))
    np.testing.assert_array_equal(yb, b(x))
    for other in (Linear(8, 4, fp8=True, rngs=rngs), Linear(7, 4, rngs=rngs)):
        with pytest.raises(ValueError, match="linears: fused_linear"):
            fused_linear(x, [a, other])
    with pytest.raises(ValueError, match="x: expected last dim 8"):
        fused_linear(x[:, :5], [a, b])
