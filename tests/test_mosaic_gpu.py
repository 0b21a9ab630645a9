"""The Mosaic GPU backend on a CPU: its layouts and permutations, its refusals, and (jax >=
0.11) that every kernel variant lowers for CUDA. Numbers on the GPU: docs/mosaic_gpu.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_attention import numerics
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.mosaic_gpu import config, regroup
from pallas_kernels.fp8_attention.mosaic_gpu import quantize as mq
from pallas_kernels.fp8_attention.tiles import NumericsTiles

JAX_011 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def test_regroup_permutation_is_the_documented_one_and_keeps_dots():
    cols = np.arange(32)
    new = np.asarray(regroup.permute_columns(jnp.asarray(cols)))
    # new column 4t + 2h + e holds source column 8h + 2t + e, in every block of 16
    for g in range(2):
        for t in range(4):
            for h in range(2):
                for e in range(2):
                    assert new[16 * g + 4 * t + 2 * h + e] == 16 * g + 8 * h + 2 * t + e
    p = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
    v_t = jax.random.normal(jax.random.PRNGKey(1), (16, 64))  # [D, keys]
    permuted = regroup.permute_columns(p) @ regroup.permute_tokens(v_t[None, None])[0, 0].T
    np.testing.assert_allclose(permuted, p @ v_t.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [mq.quantize, mq.quantize_in_input_layout])
def test_quantize_pass_matches_the_contract(variant):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 300, 3, 64))
    x = x * jnp.exp(jax.random.normal(jax.random.PRNGKey(1), (2, 300, 3, 1)))
    x = x.at[0, 5, 1, 3].set(jnp.nan)  # flags its token, changes no scale
    got = variant(x, k_major=True)
    bhtd = jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, 84), (0, 0)))
    want, scales = numerics.quantize_tokens(numerics.finite_or_zero(bhtd))
    as_f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(as_f32(got.values), as_f32(want))
    np.testing.assert_array_equal(
        as_f32(got.values_t), as_f32(regroup.permute_tokens(jnp.swapaxes(want, 2, 3)))
    )
    np.testing.assert_array_equal(
        np.asarray(got.inv_tokens), np.repeat(1 / np.asarray(scales), 128, -1)
    )
    np.testing.assert_array_equal(np.asarray(got.inv_rows)[..., 0], 1 / np.asarray(scales))
    # the bad token is zeroed and flagged (the kernels poison its scores instead)
    assert as_f32(got.values)[0, 1, 5, 3] == 0 and np.isfinite(np.asarray(got.inv_tokens)).all()
    flagged = np.argwhere(np.asarray(got.nonfinite))
    np.testing.assert_array_equal(flagged, [[0, 1, 5]])


@pytest.mark.parametrize("shape", [(2, 300, 3, 64), (1, 128, 2, 256), (1, 200, 2, 192)])
def test_fused_quantize_kernel_is_bitwise_the_xla_pass(shape):
    from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel

    x = jax.random.normal(jax.random.PRNGKey(0), shape) * 3
    x = x.at[0, 5, 1, 3].set(jnp.nan).at[0, 7, 0, 0].set(jnp.inf)
    # blocks of huge and of denormal values: the scale alone must keep them in range
    x = x.at[-1, -40:, 0].multiply(1e37).at[0, :100, -1].multiply(1e-42)
    as_f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    # head dims that are not powers of two (192) run in column pieces, not the XLA pass
    jaxpr = jax.make_jaxpr(lambda x: quantize_kernel.quantize(x, k_major=True, interpret=True))
    assert "pallas_call" in str(jaxpr(x))
    for k_major in (False, True):
        got = quantize_kernel.quantize(x, k_major=k_major, interpret=True)
        want = mq.quantize(x, k_major=k_major)
        for name in ("values", "values_t", "inv_tokens", "inv_rows", "nonfinite"):
            if getattr(want, name) is None:
                assert getattr(got, name) is None
                continue
            np.testing.assert_array_equal(
                as_f32(getattr(got, name)), as_f32(getattr(want, name)), err_msg=name
            )


@pytest.mark.skipif(
    JAX_011,
    reason=f"the Triton IR capture uses jax 0.10's private lowering; this is jax {jax.__version__}",
)
def test_fused_quantize_kernel_lowers_to_triton():
    from pallas_kernels.fp8_attention.mosaic_gpu import quantize_kernel
    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    for d, warps in ((128, 4), (128, 16), (192, 16)):  # quantize_warps: a launch setting
        x = jnp.zeros((1, 256, 2, d), jnp.bfloat16)
        quantize = quantize_kernel.quantizer(True, num_warps=warps)
        modules = lower_for_cuda(lambda x: quantize(x, k_major=True), x)
        assert list(modules) == ["dm_fp8_attention_quantize"]


def _spec(causal=False, precision="fp8", d=128):
    return AttentionSpec(causal, "matched", precision, d**-0.5, NumericsTiles(64, 64, 64, 64))


def test_supported_explains_refusals():
    cfg = config.MosaicConfig()
    shape = (1, 256, 2, 128)
    fp8, bf16 = _spec(), _spec(precision="bf16")
    if not JAX_011:
        assert "jax >= 0.11" in config.supported(shape, shape, shape, jnp.bfloat16, fp8, cfg)
        return
    assert config.supported(shape, shape, shape, jnp.bfloat16, fp8, cfg) is None
    assert "precision='fp8' only" in config.supported(shape, shape, shape, jnp.bfloat16, bf16, cfg)
    odd = (1, 256, 2, 96)
    assert "multiples of 64" in config.supported(odd, odd, odd, jnp.bfloat16, fp8, cfg)
    wide = (1, 256, 2, 256)
    assert "shared memory" in config.supported(wide, wide, wide, jnp.float32, fp8, cfg)
    with pytest.raises(ValueError, match="stages"):
        config.MosaicConfig(stages=0)
    with pytest.raises(ValueError, match="quantize_warps"):
        config.MosaicConfig(quantize_warps=3)


CASES = [  # (b, t, s, hq, hkv, dqk, dv, causal, segments, dtype)
    (1, 256, 256, 2, 2, 128, 128, False, False, jnp.bfloat16),
    (1, 300, 200, 4, 2, 64, 64, True, False, jnp.float32),
    (2, 256, 256, 2, 1, 192, 128, True, True, jnp.bfloat16),
    (1, 256, 256, 2, 2, 256, 256, False, False, jnp.bfloat16),
]


@pytest.mark.skipif(
    not JAX_011, reason=f"Mosaic GPU kernels lower with jax >= 0.11; this is jax {jax.__version__}"
)
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        "x".join(map(str, c[:7])) + ("_causal" if c[7] else "") + ("_seg" if c[8] else "")
    ),
)
def test_forward_lowers_for_cuda(case):
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, s, hq, hkv, dqk, dv, causal, segments, dtype = case
    sds = jax.ShapeDtypeStruct
    args = [sds((b, t, hq, dqk), dtype), sds((b, s, hkv, dqk), dtype), sds((b, s, hkv, dv), dtype)]
    ids = [sds((b, t), jnp.int32), sds((b, s), jnp.int32)] if segments else [None, None]

    def fn(q, k, v, q_ids, kv_ids):  # the Triton quantize kernel needs a GPU to lower on 0.11
        return ops.forward(
            q,
            k,
            v,
            q_ids,
            kv_ids,
            spec=_spec(causal, d=dqk),
            config=config.MosaicConfig(fused_quantize=False),
        )

    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args, *ids)
    text = exported.mlir_module()
    assert "mosaic_gpu" in text
    assert [tuple(a.shape) for a in exported.out_avals] == [(b, t, hq, dv), (b, hq, t)]


TWIN_CASES = [  # (b, t, s, hq, hkv, d, causal, segment length)
    (1, 256, 256, 2, 2, 64, False, None),
    (1, 300, 200, 4, 2, 64, True, None),  # GQA, ragged cross lengths, causal
    (1, 512, 512, 2, 1, 64, True, None),  # more key tiles than stages: every slot reused
    # segment ids (ascending: document tiles skip and unmask tiles), GQA, causal, ragged
    # cross lengths (tests/conftest.py gives the interpreter the threads they need)
    (1, 384, 384, 2, 1, 64, True, 100),
    (1, 300, 200, 4, 2, 64, False, 90),
]


@pytest.mark.skipif(
    not JAX_011,
    reason=f"Pallas' GPU interpret mode runs Mosaic GPU kernels from jax 0.11; this is jax {jax.__version__}",
)
@pytest.mark.parametrize(
    "case",
    TWIN_CASES,
    ids=lambda c: (
        "x".join(map(str, c[:6])) + ("_causal" if c[6] else "") + ("_seg" if c[7] else "")
    ),
)
def test_interpret_twin_matches_the_emulation(case):
    """The kernel in Pallas' GPU interpret mode (threads, barriers, TMA and wgmma simulated;
    the raw register regroup replaced by its permutation in plain JAX) against the blockwise
    emulation at the kernel's tiles (64 x 128) and against f32 attention."""
    import dm_jax
    from dm_jax import reference

    b, t, s, hq, hkv, d, causal, seg = case
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k, v = jax.random.normal(ks[1], (b, s, hkv, d)), jax.random.normal(ks[2], (b, s, hkv, d))
    ids = None
    if seg:
        ids = (
            (jnp.arange(t)[None] // seg).repeat(b, 0),
            ((jnp.arange(s)[None] + 3) // seg).repeat(b, 0),
        )
    out = dm_jax.attention(
        q,
        k,
        v,
        causal=causal,
        segment_ids=ids,
        implementation="mosaic_interpret",
        config=config.MosaicConfig(fused_quantize=False),
    )
    emu, _ = reference.flash_forward(
        q, k, v, ids, causal=causal, sm_scale=d**-0.5, precision="fp8", block_q=64, block_k=128
    )
    f32 = reference.mha_reference(q, k, v, causal=causal, segment_ids=ids)
    fro = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    # equal but for exp2 against exp, which can flip an FP8 rounding of P (one row of the
    # ragged case by 1e-3: Frobenius 5e-5); a wrong mask or scale is 1e-2 or more
    assert fro(out, emu) < 2e-4
    assert fro(out, f32) < 0.1


def test_wide_output_tiles_are_stored_by_columns_to_keep_two_stages():
    """D=256 in bf16: the whole O tile leaves room for one K/V stage, O stored 128 columns
    at a time for two; narrower heads keep the whole tile."""
    from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd

    assert fwd.stages_and_out_cols(2, 32, 256, 256, jnp.bfloat16) == (2, fwd.OUT_CHUNK)
    assert fwd.stages_and_out_cols(2, 32, 128, 128, jnp.bfloat16) == (2, 128)
    assert fwd.stages_and_out_cols(2, 1, 256, 256, jnp.bfloat16) == (1, 256)  # one key tile
    assert fwd.smem_bytes(2, 256, 256, jnp.bfloat16, fwd.OUT_CHUNK) <= fwd.SMEM_BYTES


def _causal_forward_kernel(q, k, v, **kwargs):
    """(o, lse) of the forward kernel in interpret mode on q, k, v's quantized operands
    (causal, f32 output, 2 stages); ``kwargs`` add kernel arguments."""
    from pallas_kernels.fp8_attention.mosaic_gpu import forward as fwd
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    q8, k8, v8 = ops.quantize_operands(q, k, v, config.MosaicConfig(fused_quantize=False), True)
    t, d = q.shape[1], q.shape[3]
    return fwd.forward(
        *ops._kernel_operands(q8, k8, v8),
        mask=fwd.ForwardMask(t=t, s=k.shape[1], causal=True, segments=False),
        sm_scale=d**-0.5,
        stages=2,
        out_dtype=jnp.float32,
        interpret=True,
        **kwargs,
    )


@pytest.mark.skipif(
    not JAX_011,
    reason=f"Pallas' GPU interpret mode runs Mosaic GPU kernels from jax 0.11; this is jax {jax.__version__}",
)
def test_output_stored_by_columns_is_bitwise_the_whole_tile():
    """The forward kernel (interpret mode) storing O 32 f32 columns at a time writes exactly
    the bytes of the whole-tile store, and the same lse."""
    b, t, hq, d = 1, 256, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (jax.random.normal(key, (b, t, hq, d)) for key in ks)

    def run(out_cols):
        return _causal_forward_kernel(q, k, v, out_cols=out_cols)

    (o_whole, lse_whole), (o_cols, lse_cols) = run(None), run(32)
    assert bool(jnp.all(jnp.isfinite(o_whole)))
    assert bool(jnp.array_equal(o_cols, o_whole)) and bool(jnp.array_equal(lse_cols, lse_whole))
    with pytest.raises(ValueError, match="out_cols"):
        run(24)


@pytest.mark.skipif(
    not JAX_011,
    reason=f"Pallas' GPU interpret mode runs Mosaic GPU kernels from jax 0.11; this is jax {jax.__version__}",
)
def test_longest_first_forward_is_bitwise_the_grid_order():
    """The forward kernel with its causal query tiles launched longest first: output and
    lse bitwise the grid order's. Causal with a ragged length (three query CTAs, the last
    one padded), GQA (2 query heads on 1 kv head)."""
    b, t, d = 1, 320, 64
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(ks[0], (b, t, 2, d))
    k, v = (jax.random.normal(key, (b, t, 1, d)) for key in ks[1:])
    (o_grid, lse_grid), (o_longest, lse_longest) = (
        _causal_forward_kernel(q, k, v, longest_first=longest) for longest in (False, True)
    )
    assert bool(jnp.all(jnp.isfinite(o_grid)))
    assert bool(jnp.array_equal(o_longest, o_grid)) and bool(jnp.array_equal(lse_longest, lse_grid))


def test_interpreter_thread_warning(monkeypatch):
    """Too few XLA CPU threads for Pallas' GPU interpreter: one RuntimeWarning naming NPROC;
    enough: none."""
    import warnings

    from pallas_kernels.fp8_attention.mosaic_gpu import forward

    monkeypatch.setenv("NPROC", "2")
    forward.warn_interpreter_threads.cache_clear()
    with pytest.warns(RuntimeWarning, match="NPROC=8"):
        forward.warn_interpreter_threads()
    monkeypatch.setenv("NPROC", "8")
    forward.warn_interpreter_threads.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward.warn_interpreter_threads()
    forward.warn_interpreter_threads.cache_clear()
