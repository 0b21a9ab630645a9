"""The FP8 rules of dm_jax.numerics: scales, saturation, NaN, rounding."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dm_jax import numerics


def test_pow2_scale_is_exact_floor_log2_of_448_over_amax():
    rng = np.random.default_rng(0)
    amax = rng.lognormal(0.0, 8.0, 5000).astype(np.float32)
    amax = np.concatenate([amax, np.float32([448, 224, 1, 1.75, np.nextafter(1.75, 2), 3.5, 0.5])])
    got = np.asarray(numerics.pow2_scale(jnp.asarray(amax)))
    for a, s in zip(amax, got):
        want = 2.0 ** min(126, max(-126, math.floor(math.log2(448.0 / float(a)))))
        assert s == want, (a, s, want)
        # a power of two: decoding is exact and the scaled amax never exceeds 448
        assert math.frexp(float(s))[0] == 0.5
        assert float(a) * float(s) <= 448.0


def test_amax_zero_gives_scale_one():
    assert float(numerics.pow2_scale(0.0)) == 1.0
    x = jnp.zeros((1, 1, 130, 8))
    np.testing.assert_array_equal(numerics.token_block_scales(x), np.ones((1, 1, 2)))


def test_decode_of_power_of_two_scales_is_exact():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 37.0
    scale = numerics.pow2_scale(numerics.finite_amax(x))
    x8 = numerics.quantize(x, scale)
    decoded = np.asarray(numerics.dequantize(x8, scale))
    # decoding must equal the E4M3 value divided by the scale, with no further rounding
    expected = np.asarray(x8.astype(jnp.float32)).astype(np.float64) / float(scale)
    np.testing.assert_array_equal(decoded.astype(np.float64), expected)


def test_finite_overflow_saturates_instead_of_nan():
    x8 = numerics.quantize(jnp.float32([1e6, -1e6, 449.0, 447.9]), 1.0)
    np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32)), [448, -448, 448, 448])


def test_nan_and_inf_propagate_and_do_not_poison_the_scale():
    x = jnp.float32([1.0, jnp.nan, 2.0, jnp.inf, -jnp.inf, 3.0])
    amax = numerics.finite_amax(x)
    assert float(amax) == 3.0
    x8 = numerics.quantize(x, numerics.pow2_scale(amax)).astype(jnp.float32)
    out = np.asarray(x8)
    assert np.isnan(out[[1, 3, 4]]).all()
    assert np.isfinite(out[[0, 2, 5]]).all()


def test_e4m3_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(20000) * 100, rng.uniform(-448, 448, 20000)]).astype(
        np.float32
    )
    got = np.asarray(numerics.quantize(jnp.asarray(x), 1.0).astype(jnp.float32))
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_token_block_scales_cover_each_128_token_block():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 300, 16)).astype(np.float32)
    x[1, 2, 200, 5] = 1000.0  # only block 1 of (batch 1, head 2) sees it
    scales = np.asarray(numerics.token_block_scales(jnp.asarray(x)))
    assert scales.shape == (2, 3, 3)
    assert scales[1, 2, 1] == 0.25 and scales[1, 2, 0] > 1 and scales[1, 2, 2] > 1
    for blk in range(3):
        amax = np.abs(x[:, :, blk * 128 : (blk + 1) * 128]).max(axis=(-2, -1))
        np.testing.assert_array_equal(scales[..., blk], np.asarray(numerics.pow2_scale(amax)))


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_cast_operand_dtypes(precision):
    x = numerics.cast_operand(jnp.ones((4,)), 1.0, precision)
    assert x.dtype == numerics.operand_dtype(precision)


def test_cast_operand_rejects_unknown_precision():
    with pytest.raises(ValueError, match="precision"):
        numerics.cast_operand(jnp.ones((4,)), 1.0, "fp4")


def test_dequantize_keeps_the_fp8_round_trip_behind_a_barrier():
    """XLA on the GPU may drop f32 -> e4m3 -> f32 as excess precision; the barrier stops it."""
    import jax

    x = jnp.linspace(-3.0, 3.0, 64)
    fn = jax.jit(lambda x: numerics.dequantize(numerics.quantize(x, 16.0), 16.0))
    hlo = fn.lower(x).as_text()
    assert "optimization_barrier" in hlo and "f8E4M3FN" in hlo
    assert float(jnp.max(jnp.abs(fn(x) - x))) > 0  # really rounded


def test_pow2_scale_for_e5m2_uses_its_own_max():
    # E5M2's max is 57344 = 1.75 * 2^15: the same exact-floor rule with another exponent
    for amax in (1.0, 1.75, 1.76, 57344.0, 3e-3):
        want = 2.0 ** math.floor(math.log2(57344.0 / amax))
        assert float(numerics.pow2_scale(amax, 57344.0)) == want
    x8 = numerics.quantize(jnp.float32([1e9]), 1.0, jnp.float8_e5m2)
    assert float(x8.astype(jnp.float32)[0]) == 57344.0


def test_cast_probabilities_gives_quantize_bits():
    """The kernels' short cast of P equals the general rule bit for bit on [0, 1] and NaN."""
    p = np.concatenate(
        [np.random.default_rng(0).random(100_000), [0.0, 1.0, 2.0**-20, 0.5**9, np.nan]]
    )
    p = jnp.asarray(p, jnp.float32)
    short = numerics.cast_probabilities(p, "fp8")
    rule = numerics.quantize(p, numerics.p_scale("fp8"))
    assert short.dtype == rule.dtype
    np.testing.assert_array_equal(np.asarray(short).view(np.uint8), np.asarray(rule).view(np.uint8))
    bf = numerics.cast_probabilities(p, "bf16")
    np.testing.assert_array_equal(
        np.asarray(bf, np.float32), np.asarray(p.astype(jnp.bfloat16), np.float32)
    )


def test_quantize_by_own_amax_gives_quantize_bits():
    """The kernels' short cast of a dS tile (scaled by its own finite amax) equals the
    general rule bit for bit on finite values of every magnitude, signed zeros, values that
    land on 448 and in the subnormals; NaN and both infinities encode as NaN in both."""
    from pallas_kernels.fp8_attention.numerics import quantize_by_own_amax

    rng = np.random.default_rng(1)
    tiles = [rng.standard_normal((64, 64)) * 10.0 ** rng.uniform(-40, 35, (64, 1))]
    special = rng.standard_normal((64, 64))
    special[0, :4] = [np.inf, -np.inf, np.nan, -0.0]
    special[1, :3] = [0.0, 1e-40, -1e-44]  # subnormal inputs
    tiles += [special, np.zeros((64, 64)), np.full((64, 64), 448.0), np.full((64, 64), 3e-39)]
    for tile in tiles:
        x = jnp.asarray(tile, jnp.float32)
        finite = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
        scale = numerics.pow2_scale(jnp.max(finite, axis=1, keepdims=True))  # per row
        short = np.asarray(quantize_by_own_amax(x, scale)).view(np.uint8)
        rule = np.asarray(numerics.quantize(x, scale)).view(np.uint8)
        nan = 0x7F  # e4m3fn's NaN codes are 0x7F and 0xFF: the same but for the sign bit
        is_nan = (rule & 0x7F) == nan
        np.testing.assert_array_equal((short & 0x7F) == nan, is_nan)
        np.testing.assert_array_equal(short[~is_nan], rule[~is_nan])
        assert is_nan.sum() == (~np.isfinite(tile)).sum()
