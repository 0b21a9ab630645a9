"""The kernels' CPU twin and the emulation compute bitwise the same softmax delta.

A delta that differs in its last bit between two programs moves dS = P (dP^ - delta) by
an FP32 rounding, which now and then flips an FP8 rounding of dS and moves dQ, dK by about
1e-4 of their largest value. Both programs therefore sum every delta in one fixed order
(``numerics.row_dot``); before that, seed 3 below differed by 2e-4 (stale) on one CPU and
the matched case of the correctness script on another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dm_jax
from dm_jax import numerics

T = 300  # ragged: padding in the last tiles


def _inputs(seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    n = jax.random.normal
    q = n(ks[0], (1, T, 4, 64))
    k, v = n(ks[1], (1, T, 2, 64)), n(ks[2], (1, T, 2, 64))
    return q, k, v, n(ks[3], (1, T, 4, 64))


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("delta", ["matched", "do_matched", "stale"])
def test_kernel_gradients_equal_the_emulation_with_segments(seed, delta):
    q, k, v, do = _inputs(seed)
    segments = (1 + jnp.arange(T) // 100)[None].astype(jnp.int32)

    def grads(implementation):
        # dO is an argument, not a constant of the program: both seeds compile one program
        # per implementation (the second comes from the compilation cache, conftest.py)
        def loss(q, k, v, do):
            out = dm_jax.attention(
                q,
                k,
                v,
                causal=True,
                delta=delta,
                segment_ids=segments,
                implementation=implementation,
            )
            return jnp.sum(out * do)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, do)

    for name, a, b in zip("qkv", grads("pallas_interpret"), grads("reference")):
        a, b = np.asarray(a), np.asarray(b)
        # only the order of the final FP32 sums over tiles and heads differs: no FP8 flip
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b)), f"d{name}"


@pytest.mark.parametrize("n", [1, 5, 64, 192])
def test_row_dot_gives_the_same_bits_to_every_caller(n):
    a = jax.random.normal(jax.random.PRNGKey(n), (3, 7, n))
    b = jax.random.normal(jax.random.PRNGKey(n + 1), (3, 7, n))
    eager = np.asarray(numerics.row_dot(a, b))
    inside = jax.jit(
        lambda a, b: numerics.row_dot(jnp.swapaxes(a, 0, 1), jnp.swapaxes(b, 0, 1)) * 2
    )
    np.testing.assert_array_equal(np.asarray(inside(a, b)), 2 * np.swapaxes(eager, 0, 1))
    # the fixed order: pairwise over a zero-padded power of two
    x = np.pad(
        np.asarray(a, np.float64) * np.asarray(b, np.float64),
        ((0, 0), (0, 0), (0, (1 << max(n - 1, 0).bit_length()) - n)),
    )
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    np.testing.assert_allclose(eager, x[..., 0], rtol=0, atol=1e-5 * np.abs(x).max())
