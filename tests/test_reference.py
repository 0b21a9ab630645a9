"""The blockwise FP8/bf16 reference against high-precision attention, every feature.

Tolerances (relative Frobenius error vs f32 attention, unit-normal inputs, random dO),
measured worst over 3 seeds x the REFERENCE_CASES of pallas_kernels/fp8_attention/arg_specs.py x
causal/non-causal x
delta modes: fp8 forward 0.056, gradients 0.069; bf16 forward 0.0034, gradients 0.0043.
The bounds below leave ~40% head-room over those measurements.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import dm_jax
from dm_jax import reference
from dm_jax.diagnostics import row_sum_residuals
from dm_jax.numerics import DELTA_MODES
from pallas_kernels.fp8_attention.arg_specs import REFERENCE_CASES as PROBLEMS
from pallas_kernels.fp8_attention.arg_specs import Case as Problem
from pallas_kernels.fp8_attention.tiles import NumericsTiles

TOL = {"fp8": (0.08, 0.10), "bf16": (0.006, 0.007)}  # (forward, gradients)


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def fwd_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(do)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_and_bf16_track_high_precision(problem, causal):
    q, k, v, do = problem.arrays(seed=hash(problem.name) % 1000 + causal)
    want = fwd_and_grads(
        lambda q, k, v: reference.mha_reference(q, k, v, causal=causal), q, k, v, do
    )
    for precision, (tol_fwd, tol_grad) in TOL.items():
        for delta in DELTA_MODES if precision == "fp8" else ("matched",):
            got = fwd_and_grads(
                lambda q, k, v: dm_jax.attention(
                    q, k, v, causal=causal, precision=precision, delta=delta
                ),
                q,
                k,
                v,
                do,
            )
            errs = [rel_err(g, w) for g, w in zip(got, want)]
            assert errs[0] < tol_fwd, (precision, delta, errs)
            assert max(errs[1:]) < tol_grad, (precision, delta, errs)
            # FP8 must really be coarser than bf16 (the emulation is not silently exact)
            if precision == "fp8":
                assert errs[0] > 0.01


def test_segment_ids_match_separate_sequences():
    """Packed documents give the same result as running each document alone."""
    q, k, v, do = Problem("seg", 1, 192, 192, 2, 2, 64, 64).arrays(seed=5)
    cut = 70
    seg = jnp.concatenate([jnp.zeros((1, cut), jnp.int32), jnp.ones((1, 192 - cut), jnp.int32)], 1)
    for causal in (False, True):
        packed = reference.mha_reference(q, k, v, causal=causal, segment_ids=seg)
        first = reference.mha_reference(q[:, :cut], k[:, :cut], v[:, :cut], causal=causal)
        np.testing.assert_allclose(packed[:, :cut], first, atol=1e-5)
        got = dm_jax.attention(q, k, v, causal=causal, segment_ids=seg, precision="bf16")
        assert rel_err(got, packed) < TOL["bf16"][0]
        # a (q_ids, kv_ids) pair is the same as one shared array
        pair = dm_jax.attention(q, k, v, causal=causal, segment_ids=(seg, seg), precision="bf16")
        np.testing.assert_array_equal(got, pair)
        grads = jax.grad(
            lambda q: jnp.sum(dm_jax.attention(q, k, v, causal=causal, segment_ids=seg) * do)
        )(q)
        want = jax.grad(
            lambda q: jnp.sum(reference.mha_reference(q, k, v, causal=causal, segment_ids=seg) * do)
        )(q)
        assert rel_err(grads, want) < TOL["fp8"][1]


class JitVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_no_jit_agree(self):
        q, k, v, do = PROBLEMS[0].arrays(seed=11)

        @self.variant
        def fwd_bwd(q, k, v):
            return fwd_and_grads(
                lambda q, k, v: dm_jax.attention(q, k, v, causal=True), q, k, v, do
            )

        got = fwd_bwd(q, k, v)
        want = fwd_and_grads(
            lambda q, k, v: reference.mha_reference(q, k, v, causal=True), q, k, v, do
        )
        chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
        assert rel_err(got[0], want[0]) < TOL["fp8"][0]
        for g, w in zip(got[1:], want[1:]):
            assert rel_err(g, w) < TOL["fp8"][1]


def test_check_grads_on_bf16_path():
    q, k, v, _ = Problem("cg", 1, 32, 32, 2, 1, 16, 16).arrays(seed=3)

    def f(q, k, v):
        return dm_jax.attention(q, k, v, causal=True, precision="bf16", tiles=SMALL_TILES)

    # bf16 rounding makes the function piecewise constant at tiny steps: use a step of a
    # few bf16 ulps and a tolerance at bf16 level.
    check_grads(f, (q, k, v), order=1, modes=("rev",), eps=3e-2, atol=5e-2, rtol=5e-2)


SMALL_TILES = NumericsTiles(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)


def test_nan_in_one_query_row_stays_in_that_row():
    q, k, v, _ = PROBLEMS[0].arrays(seed=4)
    q = q.at[0, 37, 1, 5].set(jnp.nan)
    out = np.asarray(dm_jax.attention(q, k, v))
    assert np.isnan(out[0, 37, 1]).all()
    bad = np.isnan(out)
    bad[0, 37, 1] = False
    assert not bad.any()


def test_inf_in_keys_propagates():
    q, k, v, _ = PROBLEMS[0].arrays(seed=4)
    out = dm_jax.attention(q, k.at[0, 3, 0, 0].set(jnp.inf), v)
    assert np.isnan(np.asarray(out)).any()


@pytest.mark.parametrize("causal", [False, True])
def test_zero_row_sum_property(causal):
    """matched: pre-cast row sums at FP32 rounding; stale at FP8 error; do_matched between."""
    q, k, v, do = PROBLEMS[0].arrays(seed=21 + causal)
    res = {d: row_sum_residuals(q, k, v, do, causal=causal, delta=d) for d in DELTA_MODES}
    pre = {d: np.asarray(r["pre_cast"]) for d, r in res.items()}
    assert pre["matched"].max() <= 1e-6
    assert np.median(pre["stale"]) > 1e-3  # FP8 error level
    assert np.median(pre["matched"]) < np.median(pre["do_matched"]) < np.median(pre["stale"])
    # the FP8 cast of dS adds a residual of its own, but far less than stale's
    post = {d: np.asarray(r["post_cast"]) for d, r in res.items()}
    assert np.mean(post["stale"]) > 1.3 * np.mean(post["matched"])


def test_bf16_matched_row_sums_also_cancel():
    q, k, v, do = PROBLEMS[0].arrays(seed=8)
    r = row_sum_residuals(q, k, v, do, delta="matched", precision="bf16")
    assert np.asarray(r["pre_cast"]).max() <= 1e-6


def test_output_dtype_follows_q():
    q, k, v, do = PROBLEMS[0].arrays(seed=1, dtype=jnp.bfloat16)
    out, vjp = jax.vjp(lambda q, k, v: dm_jax.attention(q, k, v), q, k, v)
    assert out.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in vjp(do))
