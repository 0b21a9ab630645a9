"""Causality of the FP8 attention core (docs/numerics.md, "Causality of the attention core").

* Q, K, V are scaled per (batch, head, 128-token block): a token in a later block changes
  no earlier output bit; a later token of the same block can move the block's scale, which
  changes earlier outputs only where values fall into E4M3's subnormal range (measured
  here: far below the FP8 error itself).
* Masked pairs contribute nothing, NaN included: a NaN in token 3's Q, K, V or dO reaches
  exactly the outputs and gradients of the queries that see it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dm_jax
from dm_jax.numerics import SCALE_BLOCK
from dm_jax.reference import mha_reference

B, H, D = 2, 4, 64


def _qkv(t, seed=0):
    return tuple(
        jax.random.normal(k, (B, t, H, D)) for k in jax.random.split(jax.random.key(seed), 3)
    )


def _core(q, k, v):
    return dm_jax.attention(q, k, v, causal=True, implementation="reference")


@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_scale_blocks_bound_how_far_a_later_token_reaches(operand):
    t, later, early = 2 * SCALE_BLOCK, 110, 100
    qkv = dict(zip("qkv", _qkv(t)))
    base = _core(**qkv)
    fp8_err = jnp.abs(base - mha_reference(**qkv, causal=True))[:, :early]

    def moved(token):  # a 256x outlier at `token` (its block's amax, hence scale, moves)
        return _core(**dict(qkv, **{operand: qkv[operand].at[:, token].multiply(256.0)}))

    next_block = moved(SCALE_BLOCK + 72)
    np.testing.assert_array_equal(next_block[:, :SCALE_BLOCK], base[:, :SCALE_BLOCK])
    change = jnp.abs(moved(later) - base)[:, :early]
    assert float(change.max()) > 0  # the effect exists...
    # ...and stays far below the FP8 error of the same outputs (measured: 2% of its mean)
    assert float(change.mean()) < 0.1 * float(fp8_err.mean())
    assert float(change.max()) < float(fp8_err.max())


def _visible(t, seg):
    """[T, T] bool: query i sees key j (causal, same segment)."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    return (j <= i) & (seg[:, None] == seg[None, :])


@pytest.mark.parametrize("implementation", ["reference", "triton_interpret"])
@pytest.mark.parametrize("bad", ["q", "k", "v", "do"])
def test_a_nan_reaches_only_the_queries_that_see_it(implementation, bad):
    t, tok = 40, 3
    seg_np = np.array([0] * 20 + [1] * 20)
    q, k, v = _qkv(t, seed=1)
    do = jax.random.normal(jax.random.key(2), (B, t, H, D))

    def run(value):
        args = dict(q=q, k=k, v=v, do=do)
        args[bad] = args[bad].at[:, tok].set(value)
        f = lambda q, k, v: dm_jax.attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=jnp.asarray(seg_np)[None].repeat(B, 0),
            implementation=implementation,
        )
        out, vjp = jax.vjp(f, args["q"], args["k"], args["v"])
        return (out, *vjp(args["do"]))

    sees = _visible(t, seg_np)
    # rows whose scores turn NaN: the bad query (Q, dO) or every query seeing the bad key
    rows = sees[:, tok] if bad in ("k", "v") else np.arange(t) == tok
    keys = sees[rows].any(0)  # keys those rows see: their dK, dV take the NaN
    nan_rows = {"out": rows if bad != "do" else np.zeros(t, bool), "dq": rows}
    nan_rows.update(dk=keys, dv=keys)
    zeroed = run(0.0)  # non-finite tokens are zeroed for the dots: the rest is bitwise this
    for name, x, x0 in zip(("out", "dq", "dk", "dv"), run(jnp.nan), zeroed):
        nan_tokens = np.isnan(np.asarray(x)).any(axis=(0, 2, 3))
        np.testing.assert_array_equal(nan_tokens, nan_rows[name], err_msg=name)
        clean = ~nan_rows[name]
        np.testing.assert_array_equal(np.asarray(x)[:, clean], np.asarray(x0)[:, clean], name)
