"""What only the Triton backend has: its launch config and the checks of what it runs, and the
FP8 accumulation hook, read from the Triton IR lowered for CUDA on this host."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import dm_jax
from dm_jax import backends, jaxpr_walk
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.tiles import NumericsTiles, default_tiles
from pallas_kernels.fp8_attention.triton import fp8_accumulation
from pallas_kernels.fp8_attention.triton.config import TritonConfig, default_config, supported
from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda


def _spec(tiles, causal=False):
    return AttentionSpec(causal, "matched", "fp8", 0.125, tiles)


def test_supported_explains_each_refusal():
    q, cfg = (1, 64, 2, 64), TritonConfig()
    assert supported(q, q, q, jnp.bfloat16, _spec(default_tiles(64, 64)), cfg) is None
    wide = (1, 64, 2, 320)
    assert "multiples of 16" in supported(
        wide, wide, wide, jnp.float32, _spec(default_tiles(320, 320)), cfg
    )
    odd = (1, 64, 2, 40)
    assert "Dqk=40" in supported(odd, odd, q, jnp.float32, _spec(default_tiles(64, 64)), cfg)
    assert "float8" in supported(q, q, q, jnp.float8_e4m3fn, _spec(default_tiles(64, 64)), cfg)
    d256 = (1, 64, 2, 256)
    big_tiles = NumericsTiles(block_q=128, block_k=64)
    assert "at most 64 tokens" in supported(d256, d256, d256, jnp.bfloat16, _spec(big_tiles), cfg)


def test_config_is_checked():
    with pytest.raises(ValueError, match="fp8_accumulation must be one of"):
        TritonConfig(fp8_accumulation="fp32")
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        TritonConfig(num_warps=3)
    with pytest.raises(ValueError, match="bwd_num_stages must be at least 1"):
        TritonConfig(bwd_num_stages=0)
    assert default_config(256, 256).bwd_num_warps == 8


def test_another_backends_config_is_refused():
    q = jnp.zeros((1, 32, 1, 32))
    with pytest.raises(ValueError, match="^config: expected a TritonConfig for 'triton_interpret'"):
        dm_jax.attention(q, q, q, implementation="triton_interpret", config=object())


def _fwd_bwd_kernels(config, q):
    """{kernel name: Triton IR} of one forward and backward of the Triton backend, lowered
    for CUDA on this host (no GPU needed)."""
    triton = backends.get("triton")
    spec = _spec(default_tiles(64, 64))

    def step(q):
        out, lse = triton.forward(q, q, q, None, None, spec=spec, config=config)
        return triton.backward(q, q, q, out, lse, out, None, None, spec=spec, config=config).dq

    return lower_for_cuda(step, q)


def test_fp8_accumulation_mode_is_per_kernel_under_plain_jit():
    """TritonConfig(fp8_accumulation=...) sets each kernel's request with no context
    manager: lowered for the GPU (on any host), the dots of "fast" kernels ask Triton for
    max_num_imprecise_acc = 2^30 (FP8 wgmma, never promoted), those of "promote32" kernels
    for 32 (wgmma, FP32 after every 32 products), and "precise" ones ask for nothing."""
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    modules = {}
    for mode in ("fast", "precise", "promote32"):
        config = dataclasses.replace(default_config(64, 64), fp8_accumulation=mode)
        modules.update(_fwd_bwd_kernels(config, q))
    by_mode = {
        m: {n: t for n, t in modules.items() if n.endswith(suffix)}
        for m, suffix in (("fast", "_accfast"), ("promote32", "_accpromote32"))
    }
    by_mode["precise"] = {n: t for n, t in modules.items() if "_acc" not in n}
    assert [len(k) for k in by_mode.values()] == [4, 4, 4]  # forward, delta, dQ, dK/dV
    for mode, want in (("fast", "1073741824"), ("promote32", "32")):
        assert all(
            m.count(f"maxNumImpreciseAcc = {want} ") == m.count("tt.dot ") > 0
            for m in by_mode[mode].values()
        ), mode
    assert not any("maxNumImpreciseAcc" in m for m in by_mode["precise"].values())


def test_fp8_accumulation_falls_back_where_the_private_api_is_missing(monkeypatch):
    """Where jax's private Pallas-Triton lowering is not as expected, asking for wgmma
    accumulation warns (once) and lowers every dot without the request: the precise path."""
    monkeypatch.setattr(fp8_accumulation, "_lowering_module", lambda: None)
    monkeypatch.setattr(fp8_accumulation, "_warned", [])
    with pytest.warns(RuntimeWarning, match="precise path"):
        assert fp8_accumulation.install() is False
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    config = dataclasses.replace(default_config(64, 64), fp8_accumulation="fast")
    with fp8_accumulation._dots_accumulate(fp8_accumulation.NEVER_PROMOTE) as active:
        assert active is False
        modules = _fwd_bwd_kernels(config, q)
    assert modules and not any("maxNumImpreciseAcc" in m for m in modules.values())


def test_triton_config_picks_triton_under_pallas(monkeypatch, caplog):
    """With implementation="pallas", a TritonConfig chooses the Triton backend (shown here
    with a GPU pretended, resolving only)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((1, 64, 2, 64))
    spec = _spec(default_tiles(64, 64))
    with caplog.at_level("DEBUG", logger="dm_jax.backends"):
        backend, config = backends.resolve("pallas", q, q, q, spec, TritonConfig(num_warps=8))
    assert backend.name == "triton" and config.num_warps == 8
    assert "implementation='pallas' runs 'triton'" in caplog.text


def _kernel_grids(fn, *args) -> dict:
    """{pallas_call name: grid} of every kernel in ``fn``'s jaxpr."""
    return {
        eqn.params["name"]: tuple(eqn.params["grid_mapping"].grid)
        for eqn in jaxpr_walk.equations(jax.make_jaxpr(fn)(*args))
        if eqn.primitive.name == "pallas_call"
    }


@pytest.mark.parametrize("ds_scale, dkdv_programs", [("rows", 8), ("tile", 4)])
def test_dkdv_pass_keys_per_program_on_64_x_128_ds_tiles(ds_scale, dkdv_programs):
    """On a 64 x 128 dS tile, the dK/dV pass launches TritonConfig.dkdv_keys (64) keys per
    program when dS^ is scaled per tile row (dK's scales are per key over 64 queries: the
    key width is free; at 128 keys its dK and dV accumulators made the pass 2.7x slower on
    an H100), and the dS tile's 128 with per-tile scales. dK and dV are the bits of the
    64 x 64 tiles' with per-row scales."""
    from pallas_kernels.fp8_attention.triton import ops as triton

    ks = jax.random.split(jax.random.key(3), 4)
    q, k, v, do = (jax.random.normal(kk, (1, 512, 2, 64), jnp.bfloat16) for kk in ks)
    config = default_config(64, 64)

    def grads(tiles):
        spec = AttentionSpec(True, "matched", "fp8", 0.125, tiles)

        def step(q, k, v, do):
            out, lse = triton.forward(q, k, v, None, None, spec=spec, config=config, interpret=True)
            return triton.backward(
                q, k, v, out, lse, do, None, None, spec=spec, config=config, interpret=True
            )

        grids = _kernel_grids(step, q, k, v, do)
        return jax.jit(step)(q, k, v, do), grids

    wide = NumericsTiles(64, 128, 64, 128, ds_scale=ds_scale)
    (_, dk, dv, *_), grids = grads(wide)
    (dkdv,) = [g for name, g in grids.items() if name.startswith("dm_fp8_attention_dkdv")]
    assert dkdv[0] == dkdv_programs  # 512 keys / keys per program
    if ds_scale == "rows":
        (_, dk64, dv64, *_), _ = grads(NumericsTiles(64, 128, 64, 64))
        assert jnp.array_equal(dk, dk64) and jnp.array_equal(dv, dv64)
