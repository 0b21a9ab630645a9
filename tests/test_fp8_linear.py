"""FP8 linear layers (dm_jax.nn.fp8): per-token scaling keeps every token's output its own,
per-tensor scaling (kept for comparison) does not; both stay close to f32, forward and
backward, and every matmul stays a plain FP8 dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dm_jax import jaxpr_walk
from dm_jax.nn import fp8
from dm_jax.nn.matmul import compute_dtype_matmul

M, K, N = 48, 64, 40


def _inputs(seed=0):
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    # rows of very different magnitudes, as activations with outlier tokens have
    row_gain = jnp.exp2(jax.random.randint(kr, (M, 1), -12, 5).astype(jnp.float32))
    x = jax.random.normal(kx, (M, K)) * row_gain
    return x, jax.random.normal(kw, (K, N)) * K**-0.5


def _rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_forward_and_backward_are_close_to_f32(scaling):
    x, w = _inputs()
    dy = jax.random.normal(jax.random.key(9), (M, N))
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_matmul(x, w, scaling), x, w)
    y_ref, vjp_ref = jax.vjp(jnp.matmul, x, w)
    assert y.dtype == jnp.float32 and y.shape == (M, N)
    # per row: E4M3 rounds each operand to 2^-4 relative; the output keeps that size
    row_err = jnp.abs(y - y_ref).max(1) / jnp.abs(y_ref).max(1)
    dx, dw = vjp(dy)
    dx_ref, dw_ref = vjp_ref(dy)
    if scaling == "per_token":
        assert float(row_err.max()) < 0.1  # every token as accurate as the others
        assert _rel(dx, dx_ref) < 0.25 and _rel(dw, dw_ref) < 0.1  # E5M2 dy: 2^-3
    else:  # the small rows share the big rows' scale and fall into E4M3's subnormals
        assert _rel(y, y_ref) < 0.1 and float(row_err.max()) > 0.1
    assert _rel(dw, dw_ref) < 0.1


def test_per_token_rows_depend_on_their_own_token_only():
    x, w = _inputs()
    other = x.at[30:].multiply(1000.0)  # later tokens with a far larger amax
    dx_seed = jax.random.normal(jax.random.key(3), (M, N))
    for scaling, same in (("per_token", True), ("per_tensor", False)):
        y, vjp = jax.vjp(lambda x: fp8.fp8_matmul(x, w, scaling), x)
        y2, vjp2 = jax.vjp(lambda x: fp8.fp8_matmul(x, w, scaling), other)
        assert bool(jnp.array_equal(y[:30], y2[:30])) is same, scaling
        if same:  # dx of a token uses that token's dy and W only
            g = dx_seed.at[30:].multiply(1e4)
            assert bool(jnp.array_equal(vjp(dx_seed)[0][:30], vjp(g)[0][:30]))


def test_scales_stay_outside_plain_fp8_dots():
    x, w = _inputs()
    for scaling in fp8.SCALINGS:
        fwd = jax.make_jaxpr(lambda x, w: fp8.fp8_matmul(x, w, scaling))(x, w)
        grads = jax.make_jaxpr(jax.grad(lambda x, w: fp8.fp8_matmul(x, w, scaling).sum(), (0, 1)))
        assert fp8.fp8_dot_count(fwd) == 1
        assert fp8.fp8_dot_count(grads(x, w)) == 3  # y, dx, dW


def test_linear_layer_takes_the_scaling_and_rejects_unknown_ones():
    lin = fp8.Linear(K, N, fp8=True, fp8_scaling="per_tensor", rngs=nnx.Rngs(0))
    x, _ = _inputs()
    w = lin.kernel.get_value()
    np.testing.assert_array_equal(
        lin(x), fp8.fp8_matmul(x.astype(jnp.bfloat16), w, "per_tensor").astype(jnp.bfloat16)
    )
    with pytest.raises(ValueError, match="scaling: must be one of"):
        fp8.Linear(K, N, fp8=True, fp8_scaling="per_row", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scaling: must be one of"):
        fp8.fp8_matmul(x, w, "blockwise")


def _bf16_linear_and_fused_pair():
    rngs = nnx.Rngs(0)
    single = fp8.Linear(48, 32, rngs=rngs)
    pair = [fp8.Linear(48, 16, rngs=rngs), fp8.Linear(48, 24, rngs=rngs)]
    return single, pair


def test_bf16_linear_backward_dots_take_bf16_operands():
    """The high-precision layers' dx and dW dots run on bf16 operands (the cotangent cast
    once), not on the FP32 cotangent that plain autodiff of an FP32-output dot gives."""
    graphdef, params = nnx.split(_bf16_linear_and_fused_pair())
    x = jax.random.normal(jax.random.key(1), (2, 8, 48), jnp.bfloat16)

    def loss(params, x):
        single, pair = nnx.merge(graphdef, params)
        ys = [single(x), *fp8.fused_linear(x, pair)]
        return sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in ys)

    dots = fp8.dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
    assert len(dots) == 6  # forward, dx, dW for each of the two matmuls
    assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots


def test_bf16_linear_weight_gradient_keeps_fp32_sums():
    """dW = x^T dy from bf16 x and dy, summed and returned in FP32: it matches the FP32
    product of the same bf16 values far below bf16's rounding (2^-9 relative); dx is
    dy W^T from the same bf16 operands, rounded once to bf16."""
    graphdef, params = nnx.split(_bf16_linear_and_fused_pair()[0])
    x = jax.random.normal(jax.random.key(2), (4, 64, 48), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(3), (4, 64, 32), jnp.bfloat16)
    _, vjp = jax.vjp(lambda params, x: nnx.merge(graphdef, params)(x), params, x)
    dparams, dx = vjp(dy)
    dw, w = dparams["kernel"][...], params["kernel"][...]
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    want = jnp.einsum("btk,btn->kn", x32, dy32, precision="highest")
    assert dw.dtype == jnp.float32
    rel = float(jnp.max(jnp.abs(dw - want)) / jnp.max(jnp.abs(want)))
    assert rel < 1e-5, rel
    w16 = w.astype(jnp.bfloat16).astype(jnp.float32)
    want_dx = jnp.einsum("btn,kn->btk", dy32, w16, precision="highest")
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), want_dx, rtol=8e-3, atol=1e-3)


def _dot_result_dtypes(closed_jaxpr) -> list:
    return [
        jnp.dtype(eqn.outvars[0].aval.dtype)
        for eqn in jaxpr_walk.equations(closed_jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_fp8_dot_writes_bf16_with_the_bits_of_the_fp32_result_cast(scaling):
    """y in bf16 straight from the FP8 dot (and dx in x's bf16) holds the bits of the FP32
    result cast to bf16: FP32 sums rounded once, the power-of-two scales exact."""
    x, w = _inputs()
    x = x.astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(9), (M, N), jnp.bfloat16)
    y16, vjp16 = jax.vjp(lambda x, w: fp8.fp8_matmul(x, w, scaling, jnp.bfloat16), x, w)
    y32, vjp32 = jax.vjp(lambda x, w: fp8.fp8_matmul(x, w, scaling).astype(jnp.bfloat16), x, w)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y16), np.asarray(y32))
    for got, want in zip(vjp16(dy), vjp32(dy)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the dots themselves write bf16 (y, dx) and FP32 (dW): no FP32 tensor of y or dx
    grads = jax.make_jaxpr(
        jax.grad(lambda x, w: fp8.fp8_matmul(x, w, scaling, jnp.bfloat16).sum(), (0, 1))
    )(x, w)
    assert _dot_result_dtypes(grads) == [jnp.bfloat16, jnp.bfloat16, jnp.float32]


def test_bf16_matmul_writes_its_result_dtype_with_the_bits_of_the_fp32_result_cast():
    x = jax.random.normal(jax.random.key(4), (2, 24, 48), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(5), (48, 40)) * 48**-0.5
    dy = jax.random.normal(jax.random.key(6), (2, 24, 40), jnp.bfloat16)
    bf16 = jnp.bfloat16
    y16, vjp16 = jax.vjp(lambda x, w: compute_dtype_matmul(x, w, bf16, None, bf16), x, w)
    y32, vjp32 = jax.vjp(lambda x, w: compute_dtype_matmul(x, w, bf16).astype(bf16), x, w)
    assert y16.dtype == bf16
    np.testing.assert_array_equal(np.asarray(y16), np.asarray(y32))
    for got, want in zip(vjp16(dy), vjp32(dy)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("use_fp8", [False, True])
def test_linear_layers_dots_write_the_layer_dtype_unless_a_bias_follows(use_fp8):
    """A layer without bias has its dots write y and dx in bf16 (dW in FP32); with a bias,
    y stays FP32 until the bias is added (one rounding, as before)."""
    x = jax.random.normal(jax.random.key(7), (2, 8, 48), jnp.bfloat16)
    for use_bias, y_dtype in ((False, jnp.bfloat16), (True, jnp.float32)):
        lin = fp8.Linear(48, 32, fp8=use_fp8, use_bias=use_bias, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(lin)

        def loss(params, x, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32))

        grads = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)
        assert _dot_result_dtypes(grads) == [y_dtype, jnp.bfloat16, jnp.float32], use_bias
        assert lin(x).dtype == jnp.bfloat16
