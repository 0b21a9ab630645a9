"""Pallas kernels (interpret mode) against the blockwise reference and high-precision
attention.

Tolerances (measured on CPU, jax 0.10.2, for the cases in tests/shapes.py):
  * kernels vs dm_jax.reference (same numerics, same tiles): max abs error <= 1e-5 of the
    largest reference value (measured <= 2e-7 relative: only the FP32 reduction order of
    the dots differs);
  * kernels vs high-precision attention (mha_reference): relative Frobenius error <= 0.1
    for the output and the gradients in FP8 (measured 0.02-0.06), <= 0.02 in bf16;
  * matched pre-cast dS row sums |sum_j dS_ij| / sum_j |dS_ij| <= 1e-6.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dm_jax
from dm_jax import reference
from dm_jax.attention import AttentionConfig
from dm_jax.backends import BACKENDS
from dm_jax.diagnostics import row_sum_residuals
from pallas_kernels.fp8_attention.triton.config import BlockSizes, default_block_sizes
from tests.shapes import KERNEL_CASES, Case

TIGHT = 1e-5
# Small tiles so every case runs several query and key tiles (and uneven fwd/bwd tiles).
SMALL_TILES = BlockSizes(block_q=64, block_k=32, bwd_block_q=32, bwd_block_k=64)


def _tiles(case):
    return SMALL_TILES if max(case.dqk, case.dv) <= 128 else default_block_sizes(case.dqk, case.dv)


def _config(case, implementation="pallas_interpret"):
    return AttentionConfig(
        causal=case.causal, delta=case.delta, precision=case.precision,
        sm_scale=case.dqk ** -0.5, implementation=implementation, block_sizes=_tiles(case),
    )


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(finite, np.isfinite(a)), "non-finite entries differ"
    return np.max(np.abs(a - b)[finite], initial=0.0) / max(np.max(np.abs(b[finite]), initial=0.0), 1e-30)


def _fro_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _high_precision_grads(case, q, k, v, do):
    def f(q, k, v):
        return reference.mha_reference(q, k, v, causal=case.causal, segment_ids=case.segment_ids())

    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_kernels_match_reference(case: Case):
    """Forward and backward (dQ, dK, dV, delta, dS row statistics) vs dm_jax.reference."""
    q, k, v, do = case.arrays(seed=1)
    ids = case.segment_ids()
    q_ids, kv_ids = ids if ids is not None else (None, None)
    kern, ref = BACKENDS["pallas_interpret"], BACKENDS["reference"]
    config = _config(case)
    out, lse = kern.forward(q, k, v, q_ids, kv_ids, config=config)
    r_out, r_lse = ref.forward(q, k, v, q_ids, kv_ids, config=config)
    assert out.shape == r_out.shape and out.dtype == r_out.dtype
    assert _max_rel(out, r_out) <= TIGHT
    assert _max_rel(lse, r_lse) <= TIGHT
    # Backward from the same residuals, so only the backward kernels are compared.
    got = kern.backward(q, k, v, r_out, r_lse, do, q_ids, kv_ids, config=config)
    want = ref.backward(q, k, v, r_out, r_lse, do, q_ids, kv_ids, config=config)
    for field in ("dq", "dk", "dv", "delta", "ds_abssum_pre", "ds_abssum_post"):
        assert _max_rel(getattr(got, field), getattr(want, field)) <= TIGHT, field
    # Row sums nearly cancel: compare their error with the largest sum_j |dS_ij|.
    for field in ("ds_rowsum_pre", "ds_rowsum_post"):
        err = np.abs(np.asarray(getattr(got, field)) - np.asarray(getattr(want, field)))
        assert err.max() <= TIGHT * np.asarray(want.ds_abssum_pre).max(), field
    # Against high-precision attention: FP8 (or bf16) error level.
    hp = _high_precision_grads(case, q, k, v, do)
    tol = 0.1 if case.precision == "fp8" else 0.02
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, got.dq, got.dk, got.dv), hp):
        assert _fro_rel(a, b) <= tol, name


def test_public_op_gradients_under_random_cotangent():
    """dm_jax.attention(implementation='pallas_interpret') under jax.vjp with a random dO:
    same values as the reference implementation, FP8-level error vs high precision.
    Also checks the single-array segment_ids form and a bf16 input dtype."""
    case = Case("public", 1, 130, 130, 4, 1, 64, 64, causal=True, segment_len=50)
    q, k, v, do = case.arrays(seed=2, dtype=jnp.bfloat16)
    ids = case.segment_ids()[0]  # one [B, T] array (T == S)

    def grads(implementation):
        def f(q, k, v):
            return dm_jax.attention(q, k, v, causal=True, segment_ids=ids,
                                    implementation=implementation, block_sizes=SMALL_TILES)

        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(do)

    got, want = grads("pallas_interpret"), grads("reference")
    for a, b in zip(got, want):
        assert a.dtype == jnp.bfloat16 and a.shape == b.shape
        # bf16 outputs: one bf16 rounding apart at most
        assert _max_rel(a.astype(jnp.float32), b.astype(jnp.float32)) <= 1e-2
    hp = _high_precision_grads(case, *(x.astype(jnp.float32) for x in (q, k, v, do)))
    for a, b in zip(got, hp):
        assert _fro_rel(a.astype(jnp.float32), b) <= 0.1


@pytest.mark.parametrize("delta", ["matched", "stale"])
def test_row_sums(delta):
    """Matched: pre-cast normalized dS row sums <= 1e-6. Stale: FP8 error level (>= 1e-3)."""
    case = Case("rows", 1, 128, 192, 2, 2, 64, 64, delta=delta)
    q, k, v, do = case.arrays(seed=3)
    res = row_sum_residuals(q, k, v, do, delta=delta, implementation="pallas_interpret",
                            block_sizes=SMALL_TILES)
    pre = np.asarray(res["pre_cast"])
    assert pre.shape == (1, 2, 128)
    if delta == "matched":
        assert pre.max() <= 1e-6, pre.max()
    else:
        assert np.median(pre) >= 1e-3, np.median(pre)
    # the FP8 cast of dS always leaves a residual well above FP32 rounding
    assert np.median(np.asarray(res["post_cast"])) >= 1e-4


def test_unsupported_combinations_raise():
    q = jnp.zeros((1, 64, 1, 320), jnp.float32)
    with pytest.raises(NotImplementedError, match="multiples of 16"):
        dm_jax.attention(q, q, q, implementation="pallas_interpret")
    q = jnp.zeros((1, 64, 1, 40), jnp.float32)
    with pytest.raises(NotImplementedError, match="head dims"):
        dm_jax.attention(q, q, q, implementation="pallas_interpret")


def test_nan_propagates():
    case = Case("nan", 1, 64, 64, 1, 1, 64, 64)
    q, k, v, _ = case.arrays(seed=4)
    q = q.at[0, 5, 0, 3].set(jnp.nan)
    out = dm_jax.attention(q, k, v, implementation="pallas_interpret", block_sizes=SMALL_TILES)
    out = np.asarray(out)
    assert np.all(np.isnan(out[0, 5])) and np.all(np.isfinite(np.delete(out[0], 5, axis=0)))


def test_fp8_accumulation_mode_is_per_kernel_under_plain_jit():
    """BlockSizes(fp8_accumulation=...) sets each kernel's request with no context manager:
    lowered for the GPU (on any host), the dots of "fast" kernels ask Triton for
    max_num_imprecise_acc = 2^30 (FP8 wgmma, never promoted), those of "promote32" kernels
    for 32 (wgmma, FP32 after every 32 products), and "precise" ones ask for nothing."""

    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    modules = {}
    for mode in ("fast", "precise", "promote32"):
        bs = dataclasses.replace(default_block_sizes(64, 64), fp8_accumulation=mode)
        step = lambda q, bs=bs: jax.grad(lambda q: dm_jax.attention(
            q, q, q, implementation="pallas", block_sizes=bs).astype(jnp.float32).sum())(q)
        modules.update(lower_for_cuda(step, q))
    by_mode = {m: {n: t for n, t in modules.items() if n.endswith(suffix)}
               for m, suffix in (("fast", "_accfast"), ("promote32", "_accpromote32"))}
    by_mode["precise"] = {n: t for n, t in modules.items() if "_acc" not in n}
    assert [len(k) for k in by_mode.values()] == [4, 4, 4]  # forward, delta, dQ, dK/dV
    for mode, want in (("fast", "1073741824"), ("promote32", "32")):
        assert all(m.count(f"maxNumImpreciseAcc = {want} ") == m.count("tt.dot ") > 0
                   for m in by_mode[mode].values()), mode
    assert not any("maxNumImpreciseAcc" in m for m in by_mode["precise"].values())


def test_fp8_accumulation_mode_is_checked():
    with pytest.raises(ValueError, match="fp8_accumulation must be one of"):
        BlockSizes(fp8_accumulation="fp32")

def test_fp8_accumulation_falls_back_where_the_private_api_is_missing(monkeypatch):
    """Where jax's private Pallas-Triton lowering is not as expected, asking for wgmma
    accumulation warns (once) and lowers every dot without the request: the precise path."""
    from pallas_kernels.fp8_attention.triton import fp8_accumulation
    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    monkeypatch.setattr(fp8_accumulation, "_lowering_module", lambda: None)
    monkeypatch.setattr(fp8_accumulation, "_warned", [])
    with pytest.warns(RuntimeWarning, match="precise path"):
        assert fp8_accumulation.install() is False
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    bs = dataclasses.replace(default_block_sizes(64, 64), fp8_accumulation="fast")
    with fp8_accumulation._dots_accumulate(fp8_accumulation.NEVER_PROMOTE) as active:
        assert active is False
        modules = lower_for_cuda(lambda q: dm_jax.attention(
            q, q, q, implementation="pallas", block_sizes=bs), q)
    assert modules and not any("maxNumImpreciseAcc" in m for m in modules.values())
