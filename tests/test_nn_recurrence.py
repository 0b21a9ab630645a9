"""Linear-recurrent mixers: chunked form == naive recurrence (values and gradients), for the
shared recurrence and for each mixer layer (Gated DeltaNet, Mamba-2, KDA)."""

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
# Mamba-2 (plain, per head); packed rows carry document boundaries.
CASES = {
    "gdn": (True, 1, True),
    "kda": (True, K, True),
    "mamba2": (False, 1, True),
    "kda_unpacked": (True, K, False),
}


@pytest.mark.parametrize("delta_rule,G,packed", CASES.values(), ids=CASES.keys())
def test_chunked_equals_naive_values_and_grads(delta_rule, G, packed):
    q, k, v, g, b, seg = _inputs(0, G)
    seg = seg if packed else None
    w = jax.random.normal(jax.random.key(1), (B, T, H, V))
    ws = jax.random.normal(jax.random.key(2), (B, H, K, V))

    def loss(fn, args):
        o, S = fn(*args, delta_rule=delta_rule, segment_ids=seg)
        return jnp.sum(o * w) + jnp.sum(S * ws), (o, S)

    args = (q, k, v, g, b)
    chunked = lambda *a, **kw: recurrent_chunked(*a, chunk_size=8, **kw)
    (_, (o1, S1)), g1 = jax.jit(
        jax.value_and_grad(lambda a: loss(recurrent_naive, a), has_aux=True)
    )(args)
    (_, (o2, S2)), g2 = jax.jit(jax.value_and_grad(lambda a: loss(chunked, a), has_aux=True))(args)
    chex.assert_trees_all_close((o1, S1), (o2, S2), atol=2e-5, rtol=2e-5)
    chex.assert_trees_all_close(g1, g2, atol=5e-5, rtol=5e-5)


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
    """Each layer gives the same output with either form (the gradients of the three rules
    are compared above, on the recurrence the layers call)."""
    naive, chunked = make("naive", nnx.Rngs(0)), make("chunked", nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (2, 21, 24))
    seg = jnp.array([[0] * 9 + [1] * 12, [0] * 21], jnp.int32)
    fwd = nnx.jit(lambda m, x: m(x, segment_ids=seg))
    y1, y2 = fwd(naive, x), fwd(chunked, x)
    np.testing.assert_allclose(y1, y2, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(y1).max()) > 1e-3


@pytest.mark.parametrize("C", [1, 5, 16, 64])
def test_unit_lower_inverse_matches_triangular_solve(C):
    from jax.scipy.linalg import solve_triangular

    from dm_jax.nn.recurrence import unit_lower_inverse

    L = jnp.tril(jax.random.normal(jax.random.PRNGKey(C), (2, C, C)) * 0.3, -1) + jnp.eye(C)
    want = solve_triangular(
        L, jnp.broadcast_to(jnp.eye(C), L.shape), lower=True, unit_diagonal=True
    )
    np.testing.assert_allclose(unit_lower_inverse(L), want, atol=1e-5)
