"""The Mosaic GPU backward on a CPU: which calls it runs, that its kernels lower for CUDA,
and (Pallas' GPU interpret mode, jax >= 0.11) that its gradients, delta and dS row sums are
the emulation's. Numbers on the GPU: docs/mosaic_gpu.md."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dm_jax import backends
from pallas_kernels.fp8_attention.api import AttentionSpec
from pallas_kernels.fp8_attention.mosaic_gpu import backward, backward_ops, config
from pallas_kernels.fp8_attention.tiles import NumericsTiles, default_tiles

JAX_011 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
NEEDS_011 = pytest.mark.skipif(
    not JAX_011,
    reason=f"Mosaic GPU kernels lower and interpret with jax >= 0.11; this is jax {jax.__version__}",
)


def _spec(causal=False, delta="matched", d=64, tiles=None, ds_scale="rows"):
    tiles = tiles or dataclasses.replace(default_tiles(d, d), ds_scale=ds_scale)
    return AttentionSpec(causal, delta, "fp8", d**-0.5, tiles)


def test_reason_names_what_the_mosaic_backward_leaves_to_triton():
    shape = (1, 256, 2, 128)
    assert backward_ops.reason(shape, shape, jnp.bfloat16, _spec(d=128)) is None
    wide = (1, 256, 2, 256)
    narrow_only = backward_ops.reason(wide, wide, jnp.bfloat16, _spec(d=256), wide_heads=False)
    assert "backward_wide_heads=False" in narrow_only
    reason = backward_ops.reason
    assert reason(wide, wide, jnp.bfloat16, _spec(d=256)) is None
    # f32 gradients at D=256 fit one launch per gradient, not one per 128-column chunk
    assert reason(wide, wide, jnp.float32, _spec(d=256)) is None
    assert "use bfloat16" in reason(wide, wide, jnp.float32, _spec(d=256), launches="per_chunk")
    mla_q, mla_v = (1, 256, 2, 192), (1, 256, 2, 128)
    # 192/128's default dS tile is the Mosaic backward's 64 x 64; 64 x 32 goes to Triton
    assert default_tiles(192, 128).ds_tile == (64, 64)
    assert reason(mla_q, mla_v, jnp.bfloat16, _spec(d=192)) is None
    triton_tile = _spec(d=192, tiles=NumericsTiles(64, 64, 64, 32))
    assert "64 x 64" in reason(mla_q, mla_v, jnp.bfloat16, triton_tile)
    odd = (1, 256, 2, 96)
    assert "multiples of 64" in reason(odd, odd, jnp.bfloat16, _spec(d=96))
    narrow_q, wide_v = (1, 256, 2, 64), (1, 256, 2, 192)
    assert "dv <= dqk" in reason(narrow_q, wide_v, jnp.bfloat16, _spec(d=64), launches="per_chunk")
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    sds = jax.ShapeDtypeStruct  # what correctness records name as the backward's kernels
    cfg = config.MosaicConfig()
    bf16_256, f32_256 = sds(wide, jnp.bfloat16), sds(wide, jnp.float32)
    assert ops.backward_kernels(bf16_256, bf16_256, _spec(d=256), cfg) == "mosaic"
    # f32 gradients at D=256 fit shared memory one launch per gradient (the dV launch
    # stages no dO, the dK launch one 128-column tile), not one per chunk
    assert ops.backward_kernels(f32_256, f32_256, _spec(d=256), cfg) == "mosaic"
    per_chunk = config.MosaicConfig(backward_wide_launches="per_chunk")
    assert ops.backward_kernels(f32_256, f32_256, _spec(d=256), per_chunk) == "triton"
    off = config.MosaicConfig(backward_wide_heads=False)
    assert ops.backward_kernels(bf16_256, bf16_256, _spec(d=256), off) == "triton"
    other_tile = _spec(d=128, tiles=NumericsTiles(64, 128, 64, 32))
    assert "64 x 64" in backward_ops.reason(shape, shape, jnp.bfloat16, other_tile)
    # 64 x 128: the dQ pass steps 128 keys where dS^ takes one scale per query
    dq_wide = _spec(d=128, tiles=NumericsTiles(64, 128, 64, 128))
    assert backward_ops.reason(shape, shape, jnp.bfloat16, dq_wide) is None
    per_tile = _spec(d=128, tiles=NumericsTiles(64, 128, 64, 128, ds_scale="tile"))
    assert "64 x 64" in backward_ops.reason(shape, shape, jnp.bfloat16, per_tile)
    with pytest.raises(ValueError, match="backward_stages"):
        config.MosaicConfig(backward_stages=5)


LOWER_CASES = [  # (b, t, s, hq, hkv, d or (dqk, dv), causal, segments, delta, delta_key_tile)
    (1, 256, 256, 2, 2, 128, False, False, "matched", 64),
    (2, 300, 200, 4, 2, 64, True, True, "stale", 64),
    (1, 384, 384, 2, 1, 128, True, False, "do_matched", 64),
    (2, 300, 200, 4, 2, 128, True, True, "matched", 128),
    # head dims over 128: a launch per 128-column chunk of dQ, dK and dV
    (1, 256, 256, 2, 1, 256, True, False, "matched", 128),
    (2, 300, 200, 4, 2, (192, 128), True, True, "matched", 128),
    # 16 query heads per kv head: the key pass loops over the heads (backward.key_pass)
    (1, 256, 256, 16, 1, 64, True, False, "matched", 128),
]


@NEEDS_011
@pytest.mark.parametrize("case", LOWER_CASES, ids=lambda c: "x".join(map(str, c)).replace(" ", ""))
def test_backward_lowers_for_cuda(case):
    _export_backward(case)


PINGPONG_LOWER_CASES = [  # as LOWER_CASES
    (1, 256, 256, 2, 2, 128, False, False, "matched", 128),
    (2, 300, 200, 4, 2, 64, True, True, "matched", 128),
]


@NEEDS_011
@pytest.mark.parametrize("case", PINGPONG_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_pingpong_backward_lowers_for_cuda(case):
    """``backward_pingpong``: the passes with the consumer warpgroups' two-party barrier."""
    _export_backward(case, backward_pingpong=True)


@NEEDS_011
@pytest.mark.parametrize("case", PINGPONG_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_dq_in_128_key_steps_lowers_for_cuda(case):
    """64 x 128 dS scale tiles (dQ's per-query scales over 128 keys): the dQ pass, stepping
    128 keys with K^T stages 128 keys wide, lowers (a kernel other than the 64 x 64 one)."""
    wide, narrow = (_export_backward(case, bwd_block_k=n) for n in (128, 64))
    assert wide != narrow


PER_GRADIENT_LOWER_CASES = [  # as LOWER_CASES: head dims over 128
    (1, 256, 256, 2, 1, 256, True, False, "matched", 128),
    (2, 300, 200, 4, 2, (192, 128), True, True, "matched", 128),
    (1, 256, 256, 2, 2, (256, 128), False, False, "stale", 128),
]


DOCUMENT_LOWER_CASES = [  # as LOWER_CASES, with segment ids (self-attention, T = S)
    (2, 256, 256, 4, 2, 128, True, True, "matched", 128),
    (1, 384, 384, 2, 2, 64, False, True, "stale", 64),
    (1, 256, 256, 2, 1, 256, True, True, "matched", 128),
]


@NEEDS_011
@pytest.mark.parametrize("case", DOCUMENT_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_document_tiles_lower_for_cuda(case):
    """``document_tiles`` (the default): the forward, the query passes and the key pass
    read their bounds rows ([B, T / 64, 32] int32 each) and lower with their CTA's range
    and three loops; off, every tile. (Their bounds are checked against the mask in
    tests/test_mosaic_documents.py, the kernels bit for bit against ``document_tiles=False``
    in interpret mode below and on the H200: `bash benchmarks/h200_mosaic.sh docs`.)"""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t = case[:2]
    bounds = f"tensor<{b}x{t // 64}x32xi32>"
    assert bounds not in _export_backward(case, document_tiles=False)
    text = _export_backward(case)
    assert bounds in text
    hq, hkv, d, causal = case[3], case[4], case[5], case[6]
    sds = jax.ShapeDtypeStruct
    cfg = config.MosaicConfig(fused_quantize=False)
    qkv = [sds((b, t, hq, d), jnp.bfloat16)] + [sds((b, t, hkv, d), jnp.bfloat16)] * 2
    ids = [sds((b, t), jnp.int32)] * 2

    def fn(q, k, v, q_ids, kv_ids):
        return ops.forward(q, k, v, q_ids, kv_ids, spec=_spec(causal, "matched", d), config=cfg)

    forward_text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*qkv, *ids).mlir_module()
    assert bounds in forward_text and "dm_fp8_attention_forward_mosaic" in forward_text


@NEEDS_011
def test_longest_first_order_lowers_for_cuda():
    """``causal_order="longest_first"``: the forward and the backward passes of a causal
    GQA call with segments and ragged lengths."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    case = (2, 300, 200, 4, 2, 128, True, True, "matched", 128)
    _export_backward(case, causal_order="longest_first")
    cfg = config.MosaicConfig(fused_quantize=False, causal_order="longest_first")
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, 300, 4, 128), jnp.bfloat16), sds((2, 200, 2, 128), jnp.bfloat16)
    ids = sds((2, 300), jnp.int32), sds((2, 200), jnp.int32)

    def fn(q, k, v, q_ids, kv_ids):
        return ops.forward(q, k, v, q_ids, kv_ids, spec=_spec(True, d=128), config=cfg)

    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(q, kv, kv, *ids)
    assert "dm_fp8_attention_forward_mosaic" in exported.mlir_module()


@NEEDS_011
@pytest.mark.parametrize("case", PER_GRADIENT_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_per_gradient_launches_lower_for_cuda(case, monkeypatch):
    """``backward_wide_launches="per_gradient"``: one dQ launch over every column, then a
    dV launch and a dK launch, each adding its dot in 128-column pieces."""
    launches = []
    real_query, real_key = backward.query_pass, backward.key_pass

    def query(*args, **kwargs):
        if kwargs["want"] == "dq":
            launches.append(("dq", kwargs["dq_cols"]))
        return real_query(*args, **kwargs)

    def key(*args, **kwargs):
        launches.append(("dkdv", kwargs["dk_cols"], kwargs["dv_cols"]))
        return real_key(*args, **kwargs)

    monkeypatch.setattr(backward, "query_pass", query)
    monkeypatch.setattr(backward, "key_pass", key)
    _export_backward(case, backward_wide_launches="per_gradient")
    dqk, dv = case[5] if isinstance(case[5], tuple) else (case[5], case[5])
    assert launches == [("dq", (0, dqk)), ("dkdv", (0, 0), (0, dv)), ("dkdv", (0, dqk), (0, 0))]


DQ_KEY_PASS_LOWER_CASES = [  # as LOWER_CASES
    (1, 256, 256, 2, 2, 128, False, False, "matched", 128),
    (2, 300, 200, 4, 2, 64, True, True, "stale", 128),
    (1, 256, 256, 2, 1, 256, True, False, "matched", 128),
    (2, 300, 200, 4, 2, (192, 128), True, True, "matched", 128),
]


@NEEDS_011
@pytest.mark.parametrize("case", DQ_KEY_PASS_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_dq_in_key_pass_lowers_for_cuda(case, monkeypatch):
    """``backward_dq="key_pass"``: the key pass with the dQ dots, its 16-bit transpose of
    dS^ and the TMA reduce-adds; no dQ pass is launched (the only query pass left is the
    matched delta's)."""
    wants = []
    real = backward.query_pass

    def counted(*args, **kwargs):
        wants.append(kwargs["want"])
        return real(*args, **kwargs)

    monkeypatch.setattr(backward, "query_pass", counted)
    _export_backward(case, with_stats=False, ds_scale="tile", backward_dq="key_pass")
    assert wants == (["delta"] if case[8] == "matched" else [])
    # with dS^ scales per tile row (per key in the key pass) the dQ pass runs instead
    wants.clear()
    _export_backward(case, with_stats=False, backward_dq="key_pass")
    assert wants == (["delta"] if case[8] == "matched" else []) + ["dq"]


@NEEDS_011
@pytest.mark.parametrize("causal, hq, hkv", [(True, 1, 1), (False, 2, 1)])
def test_dq_in_key_pass_equals_the_dq_pass(causal, hq, hkv):
    """dQ added tile by tile from the dK/dV pass (dS^ read back through its 16-bit
    transpose, one FP8 dot per tile) equals the dQ pass's up to the order of the f32 sums;
    dK, dV and delta are bitwise the same. A ragged length (T=192 in 256-token blocks), two
    key CTAs; causal, or GQA. (Causal GQA hangs jax 0.11.2's GPU interpreter on a 2-core
    machine; on the H200: benchmarks/dq_key_pass.py.) The interpreter has no reduce-add
    copy: each warpgroup writes its own partial dQ there, summed after the pass. One dS^
    scale per tile (the only scales this path takes)."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, d = 1, 192, 64
    q, k, v, do = _gqa_inputs(11, b, t, hq, hkv, d)
    spec = _spec(causal, "matched", d, ds_scale="tile")
    results = []
    for where in ("pass", "key_pass"):
        cfg = config.MosaicConfig(fused_quantize=False, backward_dq=where)
        out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
        results.append(ops.backward(q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True))
    by_pass, by_keys = results
    for name in ("dk", "dv", "delta"):
        assert bool(jnp.all(getattr(by_pass, name) == getattr(by_keys, name))), name
    assert float(jnp.max(jnp.abs(by_pass.dq))) > 0.1
    np.testing.assert_allclose(by_keys.dq, by_pass.dq, rtol=1e-5, atol=1e-6)


def test_backward_dq_is_checked():
    with pytest.raises(ValueError, match="backward_dq"):
        config.MosaicConfig(backward_dq="atomic")
    assert backward.dq_in_key_pass_fits(128, 128, jnp.bfloat16)
    assert not backward.dq_in_key_pass_fits(128, 128, jnp.float32)  # the dQ pass runs there


def _gqa_inputs(seed, b, t, hq, hkv, d):
    """(q, k, v, do), random normal: q and do [b, t, hq, d], k and v [b, t, hkv, d]."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, do = (jax.random.normal(key, (b, t, hq, d)) for key in ks[:2])
    k, v = (jax.random.normal(key, (b, t, hkv, d)) for key in ks[2:])
    return q, k, v, do


def _export_backward(case, with_stats=True, ds_scale="rows", bwd_block_k=64, **config_fields):
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, s, hq, hkv, d, causal, segments, delta, delta_key_tile = case
    d, dv = d if isinstance(d, tuple) else (d, d)
    cfg = config.MosaicConfig(fused_quantize=False, delta_key_tile=delta_key_tile, **config_fields)
    sds = jax.ShapeDtypeStruct
    q, k = sds((b, t, hq, d), jnp.bfloat16), sds((b, s, hkv, d), jnp.bfloat16)
    v, out = sds((b, s, hkv, dv), jnp.bfloat16), sds((b, t, hq, dv), jnp.bfloat16)
    lse = sds((b, hq, t), jnp.float32)
    ids = [sds((b, t), jnp.int32), sds((b, s), jnp.int32)] if segments else [None, None]

    tiles = dataclasses.replace(default_tiles(d, dv), ds_scale=ds_scale, bwd_block_k=bwd_block_k)

    def fn(q, k, v, out, lse, do, q_ids, kv_ids):  # (Triton's quantize needs a GPU on 0.11)
        return ops.backward(
            q,
            k,
            v,
            out,
            lse,
            do,
            q_ids,
            kv_ids,
            spec=_spec(causal, delta, d, tiles=tiles),
            config=cfg,
            interpret=False,
            with_stats=with_stats,
        )

    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(q, k, v, out, lse, out, *ids)
    text = exported.mlir_module()
    assert "dm_fp8_attention_key_pass_mosaic" in text
    shapes = [tuple(a.shape) for a in exported.out_avals]
    assert shapes[:4] == [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, dv), (b, hq, t)]
    assert shapes[4:] == [(b, hq, t)] * 4 * with_stats  # the dS row statistics
    if with_stats:
        assert "dm_fp8_attention_query_pass_mosaic" in text
    return text


TWIN_CASES = [  # (b, t, s, hq, hkv, d, causal, delta, segment length)
    (1, 256, 256, 2, 1, 64, False, "matched", None),  # GQA
    (1, 300, 200, 4, 2, 64, True, "stale", None),  # ragged cross lengths, causal
    # packed documents (tests/conftest.py gives the interpreter the threads they need)
    (1, 384, 384, 2, 1, 64, True, "matched", 100),
]


@NEEDS_011
@pytest.mark.parametrize("case", TWIN_CASES, ids=lambda c: "x".join(map(str, c)))
def test_interpret_twin_matches_the_emulation(case):
    """Gradients of the Mosaic backward in Pallas' GPU interpret mode (threads, barriers, TMA
    and wgmma simulated; the raw register regroup and cross-warp max replaced by plain JAX)
    against the emulation's, and Delta-Matching's pre-cast dS row sums."""
    import dm_jax
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, s, hq, hkv, d, causal, delta, seg = case
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k, v = jax.random.normal(ks[1], (b, s, hkv, d)), jax.random.normal(ks[2], (b, s, hkv, d))
    do = jax.random.normal(ks[3], (b, t, hq, d))
    cfg = config.MosaicConfig(fused_quantize=False)
    ids = None if seg is None else (jnp.arange(t)[None] // seg, jnp.arange(s)[None] // seg)

    def grads(implementation, **kw):
        def f(q, k, v):
            return dm_jax.attention(
                q,
                k,
                v,
                causal=causal,
                delta=delta,
                segment_ids=ids,
                implementation=implementation,
                **kw,
            )

        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    got = grads("mosaic_interpret", config=cfg)
    want = grads("reference")
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        err = float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))
        # equal but for the forward's exp2 against exp (a flipped FP8 rounding of P here and
        # there: 1e-4); a wrong mask, scale or permutation is 1e-2 or more
        assert err < 5e-4, (name, err)

    spec = _spec(causal, "matched", d)
    q_ids, kv_ids = ids or (None, None)
    out, lse = ops.forward(q, k, v, q_ids, kv_ids, spec=spec, config=cfg, interpret=True)
    res = ops.backward(
        q, k, v, out, lse, do, q_ids, kv_ids, spec=spec, config=cfg, interpret=True,
        with_stats=True,
    )  # fmt: skip
    # |sum_j dS_ij| against the head's mean sum_j |dS_ij| (a row that sees one key has
    # sum_j |dS_ij| of rounding size only, so a per-row ratio says nothing there)
    scale = jnp.mean(res.ds_abssum_pre, axis=-1, keepdims=True)
    assert float(jnp.max(jnp.abs(res.ds_rowsum_pre) / scale)) < 1e-5  # matched: delta cancels
    post = jnp.abs(res.ds_rowsum_post) / jnp.mean(res.ds_abssum_post, axis=-1, keepdims=True)
    assert float(jnp.median(post)) > 1e-4  # the cast's own residual is there to see


@NEEDS_011
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_document_tiles_are_bitwise_every_tile(causal):
    """``document_tiles`` (the default) in Pallas' GPU interpret mode: out, dQ, dK and dV
    bit for bit those of ``document_tiles=False`` (every tile visited, every tile masked),
    with documents of 150, 40 and 194 tokens in a ragged row (the CTAs skip tiles, run
    tiles inside one document unmasked, and reach padding)."""
    import dm_jax

    t, hq, hkv, d = 384 - 20, 2, 1, 64
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    q = jax.random.normal(ks[0], (1, t, hq, d))
    k, v = jax.random.normal(ks[1], (1, t, hkv, d)), jax.random.normal(ks[2], (1, t, hkv, d))
    do = jax.random.normal(ks[3], (1, t, hq, d))
    ids = jnp.asarray(np.repeat([4, 5, 6], [150, 40, t - 190])[None], jnp.int32)

    def run(document_tiles):
        cfg = config.MosaicConfig(fused_quantize=False, document_tiles=document_tiles)

        def f(q, k, v):
            return dm_jax.attention(
                q,
                k,
                v,
                causal=causal,
                segment_ids=ids,
                implementation="mosaic_interpret",
                config=cfg,
            )

        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(do)

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(True), run(False)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert np.isfinite(np.asarray(a)).all(), name


def test_dot_pieces_follow_segment_ids_unless_set():
    """``backward_piece_columns=0`` picks 64-column dots with segment ids or 128-key dQ
    steps, 128 otherwise;
    a set width wins; no width above MAX_COLUMNS; other widths are refused by name."""
    assert backward_ops.dot_pieces(0, segments=True) == backward.SEGMENT_PIECES == 64
    assert backward_ops.dot_pieces(0, segments=False) == backward.MAX_COLUMNS == 128
    assert backward_ops.dot_pieces(128, segments=True) == 128
    assert backward_ops.dot_pieces(64, segments=False) == 64
    # the dQ pass in 128-key steps (64 x 128 dS scale tiles): 64-column dots unless set
    assert backward_ops.dot_pieces(0, segments=False, dq_key_tile=128) == 64
    assert backward_ops.dot_pieces(128, segments=False, dq_key_tile=128) == 128
    assert backward.column_pieces(256, 64) == [(0, 64), (64, 64), (128, 64), (192, 64)]
    assert backward.column_pieces(192) == [(0, 128), (128, 64)]
    with pytest.raises(ValueError, match="backward_piece_columns"):
        config.MosaicConfig(backward_piece_columns=32)


@NEEDS_011
def test_dots_in_64_column_pieces_are_bitwise_128():
    """The backward's dots into fresh accumulators of 64 columns (the default with segment
    ids) instead of 128, in Pallas' GPU interpret mode at D=128: out, dQ, dK and dV bit for
    bit, causal, two documents in a ragged row (each column's sum is formed the same way)."""
    import dm_jax

    t, d = 192 - 9, 128
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v, do = (jax.random.normal(key, (1, t, 1, d)) for key in ks)
    ids = jnp.asarray(np.repeat([1, 2], [100, t - 100])[None], jnp.int32)

    def run(columns):
        cfg = config.MosaicConfig(fused_quantize=False, backward_piece_columns=columns)

        def f(q, k, v):
            return dm_jax.attention(
                q, k, v, causal=True, segment_ids=ids, implementation="mosaic_interpret", config=cfg
            )

        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(do)

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(0), run(128)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert np.isfinite(np.asarray(a)).all() and np.abs(np.asarray(a)).max() > 0, name


@NEEDS_011
def test_shared_quantize_makes_the_forward_calls_the_backward_calls(monkeypatch):
    """``shared_quantize``: the forward quantizes Q, K and V with exactly the backward's
    calls (same input, same outputs asked for), so XLA can run each once; without it the
    calls differ. Out, lse and the gradients are bitwise the same either way (interpret
    mode, causal GQA with a ragged length)."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops, quantize_kernel

    b, t, hq, hkv, d = 1, 130, 2, 1, 64
    q, k, v, do = _gqa_inputs(3, b, t, hq, hkv, d)
    spec = _spec(causal=True)
    real = quantize_kernel.xla_pass.quantize
    calls = []

    def record(x, **kw):
        calls.append((x, kw.get("values", True), kw.get("k_major", False)))
        return real(x, **kw)

    monkeypatch.setattr(quantize_kernel.xla_pass, "quantize", record)
    results = {}
    for shared in (False, True):
        calls.clear()
        cfg = config.MosaicConfig(fused_quantize=False, shared_quantize=shared)
        fwd = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
        n_fwd = len(calls)
        grads = ops.backward(q, k, v, fwd.out, fwd.lse, do, spec=spec, config=cfg, interpret=True)
        fwd_calls, bwd_calls = calls[:n_fwd], calls[n_fwd:]
        twins = [
            [c[1:] for c in side if c[0] is x] for x in (q, k, v) for side in (fwd_calls, bwd_calls)
        ]
        same = all(twins[i] == twins[i + 1] and len(twins[i]) == 1 for i in range(0, 6, 2))
        assert same == shared, (shared, twins)
        results[shared] = (fwd.out, fwd.lse, grads.dq, grads.dk, grads.dv)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), results[False], results[True]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name)


def _backward_under(field, values, seed, t, d=64):
    """The interpret-mode forward and backward (with the dS statistics) of one causal GQA
    call with a ragged length, once per value of ``MosaicConfig.<field>``."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, hq, hkv = 1, 2, 1
    q, k, v, do = _gqa_inputs(seed, b, t, hq, hkv, d)
    spec = _spec(True, "matched", d)
    results = []
    for value in values:
        cfg = config.MosaicConfig(fused_quantize=False, **{field: value})
        out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
        results.append(
            ops.backward(
                q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True, with_stats=True
            )
        )
    return results


def _assert_bitwise_equal(plain, other):
    assert bool(jnp.all(jnp.isfinite(plain.dq))) and float(jnp.max(jnp.abs(plain.dk))) > 0
    for name in plain._fields:
        assert bool(jnp.all(getattr(plain, name) == getattr(other, name))), name


@NEEDS_011
def test_pingpong_is_bitwise_the_same():
    """The consumer warpgroups' turns on the tensor cores change when each dot runs, not
    what it computes: delta, dQ, dK, dV and the dS row statistics bitwise equal without
    them. Causal with a ragged length, so the two warpgroups of a query CTA step through
    different numbers of key tiles (the one that stops early still takes its turns), GQA."""
    _assert_bitwise_equal(*_backward_under("backward_pingpong", (False, True), seed=5, t=320))


EARLY_P_LOWER_CASES = [  # as LOWER_CASES
    (1, 256, 256, 2, 2, 128, False, False, "matched", 128),
    (2, 300, 200, 4, 2, 64, True, True, "stale", 64),
    (1, 256, 256, 2, 1, 256, True, False, "matched", 128),
]


@NEEDS_011
@pytest.mark.parametrize("case", EARLY_P_LOWER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_early_p_and_tile_scales_lower_for_cuda(case):
    """``backward_early_p`` (P formed while the dP^ dot runs: a ``wgmma.wait_group 1``
    between the two dots' waits) lowers, with dS^ scales per tile row (the default) and
    per tile (a cross-warp amax)."""
    default = _export_backward(case)
    early = _export_backward(case, backward_early_p=True)
    assert "wgmma.wait_group.sync.aligned 1;" not in default
    assert "wgmma.wait_group.sync.aligned 1;" in early
    _export_backward(case, ds_scale="tile", backward_early_p=True)


@NEEDS_011
@pytest.mark.parametrize("case", EARLY_P_LOWER_CASES[:2], ids=lambda c: "x".join(map(str, c)))
def test_chained_dots_lower_for_cuda(case):
    """``backward_chained_dots`` (each register dot's adds while the next piece's dot runs:
    a ``wgmma.wait_group 1`` before each add but the last) lowers for CUDA."""
    default = _export_backward(case, with_stats=False)
    chained = _export_backward(case, with_stats=False, backward_chained_dots=True)
    assert "wgmma.wait_group.sync.aligned 1;" not in default
    assert "wgmma.wait_group.sync.aligned 1;" in chained


@NEEDS_011
@pytest.mark.parametrize("d", [64, 128])
def test_chained_dots_are_bitwise_the_same(d):
    """The register dots chained two in flight change when the adds run, not what they
    add: delta, dQ, dK, dV and the dS row statistics bitwise equal (causal GQA, ragged
    length; D=128 chains dQ's two 64-column pieces and dV's and dK's four; interpret
    mode)."""
    results = _backward_under("backward_chained_dots", (False, True), seed=11, t=136, d=d)
    _assert_bitwise_equal(*results)


@NEEDS_011
def test_early_p_is_bitwise_the_same():
    """P formed while the dP^ dot still runs changes when the math runs, not what it
    computes: delta, dQ, dK, dV and the dS row statistics bitwise equal (causal GQA with a
    ragged length, every pass; interpret mode)."""
    _assert_bitwise_equal(*_backward_under("backward_early_p", (False, True), seed=9, t=200))


@NEEDS_011
def test_longest_first_query_passes_are_bitwise_the_grid_order():
    """The matched-delta and dQ passes with their causal query tiles launched longest first:
    delta and dQ bitwise the grid order's (the forward's order:
    tests/test_mosaic_gpu.py). Causal with a ragged length (three query CTAs, the last one
    padded), GQA (2 query heads on 1 kv head)."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, d = 1, 320, 64
    q, k, v, do = _gqa_inputs(7, b, t, 2, 1, d)
    spec = _spec(True, "matched", d)
    cfg = config.MosaicConfig(fused_quantize=False)
    out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
    results = []
    for longest in (False, True):
        operands = backward_ops.operands(
            q, k, v, lse, do, None, None, spec=spec, stages=2,
            fused_quantize=False, interpret=True, longest_first=longest,
        )  # fmt: skip
        delta = backward_ops.delta(operands, do, out, "matched")
        dq = backward_ops.gradients(operands, delta, (jnp.float32,) * 2, passes=("dq",))[0]
        results.append((delta, dq))
    (delta_grid, dq_grid), (delta_longest, dq_longest) = results
    assert float(jnp.max(jnp.abs(dq_grid))) > 0
    assert bool(jnp.all(delta_longest == delta_grid)) and bool(jnp.all(dq_longest == dq_grid))


@NEEDS_011
def test_gqa_key_pass_heads_written_out_equal_the_head_loop(monkeypatch):
    """The key pass with each query head's loops written out one after the other (the
    default up to backward.MAX_UNROLLED_HEADS heads per kv head) and with a loop over the
    heads (larger groups): dK and dV bitwise equal. Causal, ragged, GQA 2/1."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, hq, hkv, d = 1, 192, 2, 1, 64
    assert hq // hkv <= backward.MAX_UNROLLED_HEADS  # the default run writes them out
    q, k, v, do = _gqa_inputs(13, b, t, hq, hkv, d)
    spec = _spec(True, "matched", d)
    cfg = config.MosaicConfig(fused_quantize=False)
    out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
    ops_ = backward_ops.operands(
        q, k, v, lse, do, None, None, spec=spec, stages=2, fused_quantize=False, interpret=True
    )
    delta = backward_ops.delta(ops_, do, out, "matched")
    dtypes = (jnp.float32, jnp.float32)
    _, dk, dv, _ = backward_ops.gradients(ops_, delta, dtypes, passes=("dkdv",))
    looped, real = [], backward.key_pass

    def key_pass(*args, **kwargs):
        looped.append(True)
        return real(*args, unrolled_heads=0, **kwargs)

    monkeypatch.setattr(backward, "key_pass", key_pass)
    _, dk_loop, dv_loop, _ = backward_ops.gradients(ops_, delta, dtypes, passes=("dkdv",))
    assert looped and float(jnp.max(jnp.abs(dk))) > 0
    assert bool(jnp.all(dk == dk_loop)) and bool(jnp.all(dv == dv_loop))


def test_causal_order_is_checked():
    with pytest.raises(ValueError, match="causal_order"):
        config.MosaicConfig(causal_order="reversed")


@NEEDS_011
def test_interpret_twin_masks_nan_like_the_emulation():
    """A NaN in V at token 3 (causal): the outputs of tokens 0-2 stay finite, as in the
    emulation, and every gradient has the emulation's NaN pattern and finite values."""
    import dm_jax

    b, t, h, d = 1, 256, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, t, h, d)) for key in ks)
    v = v.at[0, 3, 0, 5].set(jnp.nan)

    def run(implementation, **kw):
        def f(q, k, v):
            return dm_jax.attention(q, k, v, causal=True, implementation=implementation, **kw)

        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    got = run("mosaic_interpret", config=config.MosaicConfig(fused_quantize=False))
    want = run("reference")
    assert not jnp.isnan(got[0][0, :3]).any() and jnp.isnan(got[0][0, 3:, 0]).all()
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, want):
        assert bool(jnp.all(jnp.isnan(a) == jnp.isnan(r))), name
        ok = ~jnp.isnan(r)
        err = jnp.linalg.norm(jnp.where(ok, a - r, 0.0)) / jnp.linalg.norm(jnp.where(ok, r, 0.0))
        assert float(err) < 5e-4, (name, float(err))


def test_delta_key_tile_is_checked():
    with pytest.raises(ValueError, match="delta_key_tile must be 64 or 128"):
        config.MosaicConfig(delta_key_tile=96)


@NEEDS_011
def test_matched_delta_in_128_key_steps_equals_64():
    """The matched-delta pass with 128 keys per step (``delta_key_tile=128``) forms the same
    P and dP^ as with 64 and sums them in another order: equal to f32 rounding, causal with
    full and diagonal tiles, GQA."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    b, t, hq, hkv, d = 1, 512, 2, 1, 64
    q, k, v, do = _gqa_inputs(3, b, t, hq, hkv, d)
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, hq // hkv, axis=2)) * d**-0.5
    visible = jnp.arange(t)[:, None] >= jnp.arange(t)[None]
    lse = jax.nn.logsumexp(jnp.where(visible, scores, -jnp.inf), axis=-1)
    spec = _spec(True, "matched", d)
    deltas = []
    for key_tile in (64, 128):
        cfg = config.MosaicConfig(fused_quantize=False, delta_key_tile=key_tile)
        operands = ops._operands(q, k, v, lse, do, None, None, spec, cfg, True)
        deltas.append(backward_ops.delta(operands, do, jnp.zeros_like(q), "matched"))
    narrow, wide = deltas
    assert bool(jnp.all(jnp.isfinite(wide)))
    assert float(jnp.max(jnp.abs(wide - narrow)) / jnp.max(jnp.abs(narrow))) < 1e-6
    with pytest.raises(ValueError, match="key_tile"):
        from pallas_kernels.fp8_attention.mosaic_gpu import backward

        ops_ = ops._operands(q, k, v, lse, do, None, None, spec, config.MosaicConfig(), True)
        rows = backward_ops.query_rows(ops_, jnp.zeros_like(ops_.lse2))
        backward.query_pass(
            ops_.q8.values,
            ops_.do8.values,
            rows,
            ops_.k8.values,
            ops_.v8.values,
            ops_.kv_aux,
            ops_.kv_flags,
            ops_.k8.values_t,
            want="dq",
            key_tile=128,  # dQ steps 128 keys only with one dS^ scale per query (ds_rows)
            **dict(ops_.kwargs, ds_rows=False),
        )


@NEEDS_011
@pytest.mark.parametrize("causal, seg", [(True, None), (False, 100)], ids=["causal", "docs"])
def test_dq_in_128_key_steps_matches_the_emulation(causal, seg):
    """dS scale tiles of 64 x 128 (``NumericsTiles(bwd_block_k=128)``, one dS^ scale per
    query over 128 keys): the dQ pass steps 128 keys. In Pallas' GPU interpret mode, GQA
    2/1, ragged cross lengths (causal) or packed documents: dQ equals the emulation's on the
    same tiles; dK and dV are bit for bit those of the 64 x 64 tiles (the key pass's per-key
    scales stay over 64 queries, and dP^ is the same values); the matched pre-cast row sums
    cancel."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    t, s = (320, 200) if causal else (384, 384)
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    q, do = (jax.random.normal(key, (1, t, 2, 64)) for key in (ks[0], ks[3]))
    k, v = (jax.random.normal(key, (1, s, 1, 64)) for key in ks[1:3])
    ids = None if seg is None else (jnp.arange(t)[None] // seg, jnp.arange(s)[None] // seg)
    q_ids, kv_ids = ids or (None, None)
    cfg = config.MosaicConfig(fused_quantize=False)
    narrow = _spec(causal, "matched", 64)
    wide = dataclasses.replace(narrow, tiles=dataclasses.replace(narrow.tiles, bwd_block_k=128))
    assert backward_ops.reason(q.shape, v.shape, q.dtype, wide) is None
    out, lse = ops.forward(q, k, v, q_ids, kv_ids, spec=wide, config=cfg, interpret=True)

    def grads(spec, implementation=ops, **kw):  # (the module name `backward` stays free)
        args = (q, k, v, out, lse, do, q_ids, kv_ids)
        return implementation.backward(*args, spec=spec, **kw)

    got = grads(wide, config=cfg, interpret=True, with_stats=True)
    base = grads(narrow, config=cfg, interpret=True)
    reference = backends.get("reference")
    want = grads(wide, reference, config=reference.default_config(64, 64))
    for name in ("dk", "dv"):
        assert bool(jnp.all(getattr(got, name) == getattr(base, name))), name
    err = float(jnp.linalg.norm(got.dq - want.dq) / jnp.linalg.norm(want.dq))
    assert err < 5e-4, err  # a wrong scale, mask or permutation is 1e-2 or more
    scale = jnp.mean(got.ds_abssum_pre, axis=-1, keepdims=True)
    assert float(jnp.max(jnp.abs(got.ds_rowsum_pre) / scale)) < 1e-5


def _causal_gqa_backward(seed, t, d, wide_launches):
    """((q, k, v, do), spec, config, out, lse, the interpret-mode backward): causal
    `matched`, GQA 2/1, head dim ``d``, random normal inputs."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    q, k, v, do = _gqa_inputs(seed, 1, t, 2, 1, d)
    spec = _spec(True, "matched", d)
    cfg = config.MosaicConfig(fused_quantize=False, backward_wide_launches=wide_launches)
    out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
    whole = ops.backward(q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True)
    return (q, k, v, do), spec, cfg, out, lse, whole


@NEEDS_011
def test_column_chunks_equal_one_launch(monkeypatch):
    """``backward_wide_launches="per_chunk"``: head dims over 128 run one dQ and one dK/dV
    launch per 128 columns, each recomputing S and dP^ in full. At D=64 (the GPU interpreter does not finish D >= 128 on a 2-core
    machine): dQ in two 32-column launches equals the one launch's, and a key-pass launch
    that forms dK alone (192/128's last chunk) gives the same dK. The key pass in 32-column
    launches never finishes in jax 0.11.2's GPU interpreter (one launch of 128 columns per
    chunk runs on the H200 at D=256 and 192/128: docs/mosaic_gpu.md), so here the dK/dV
    launches stay whole."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    assert backward.column_chunks(256) == [(0, 128), (128, 128)]
    assert backward.column_chunks(192) == [(0, 128), (128, 64)]
    assert backward.column_chunks(64) == [(0, 64)]
    assert backward.key_pass_launches(192, 128, "per_chunk") == [
        ((0, 128), (0, 128)),
        ((128, 64), (0, 0)),
    ]
    assert backward.key_pass_launches(192, 128, "per_gradient") == [
        ((0, 0), (0, 128)),
        ((0, 192), (0, 0)),
    ]
    assert backward.key_pass_launches(128, 128, "per_gradient") == [((0, 128), (0, 128))]
    assert backward.query_pass_launches(256, "per_gradient") == [(0, 256)]
    t, d = 192, 64
    (q, k, v, do), spec, cfg, out, lse, whole = _causal_gqa_backward(9, t, d, "per_chunk")
    operands = ops._operands(q, k, v, lse, do, None, None, spec, cfg, True)
    tp = operands.lse2.shape[2]
    rows = backward_ops.query_rows(operands, jnp.pad(whole.delta, ((0, 0), (0, 0), (0, tp - t))))
    dk_alone, no_dv = backward.key_pass(
        operands.q8.values,
        operands.q8.values_t,
        operands.do8.values,
        operands.do8.values_t,
        rows,
        operands.k8.values,
        operands.v8.values,
        operands.kv_aux,
        backward_ops.query_flags(rows, k.shape[2]),
        out_dtype=jnp.float32,
        dv_cols=(0, 0),
        **operands.kwargs,
    )
    assert no_dv is None
    assert bool(jnp.all(dk_alone[:, :t] == whole.dk)), "dK without dV"
    launches = []
    monkeypatch.setattr(backward, "column_chunks", lambda d: [(0, d // 2), (d // 2, d // 2)])
    monkeypatch.setattr(backward, "key_pass_launches", lambda dqk, dv, *_: [((0, dqk), (0, dv))])
    real_query_pass = backward.query_pass

    def counted_query_pass(*args, **kwargs):
        launches.append(kwargs.get("dq_cols"))
        return real_query_pass(*args, **kwargs)

    monkeypatch.setattr(backward, "query_pass", counted_query_pass)
    halves = ops.backward(q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True)
    assert (0, 32) in launches and (32, 32) in launches  # the Mosaic dQ pass, split
    assert float(jnp.max(jnp.abs(whole.dq))) > 0
    # (to FP32 rounding: the interpreter's dots of 32 and 64 columns sum in other orders)
    assert float(jnp.max(jnp.abs(halves.dq - whole.dq)) / jnp.max(jnp.abs(whole.dq))) < 1e-6


@NEEDS_011
def test_per_gradient_launches_equal_one_launch(monkeypatch):
    """``backward_wide_launches="per_gradient"``: dQ in one launch, dV alone, then dK alone,
    each dot added in pieces of MAX_COLUMNS columns. At D=64 with MAX_COLUMNS set to 32
    (the GPU interpreter does not finish D >= 128 on a 2-core machine), so every launch
    takes two 32-column pieces through one reused staging tile: equal to the whole
    64-column launch to FP32 rounding (the interpreter's dots of 32 and 64 columns sum in
    other orders), causal, GQA and ragged lengths."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    d = 64
    (q, k, v, do), spec, cfg, out, lse, whole = _causal_gqa_backward(11, 160, d, "per_gradient")
    launches = []
    real_key = backward.key_pass

    def key(*args, **kwargs):
        launches.append((kwargs["dk_cols"], kwargs["dv_cols"]))
        return real_key(*args, **kwargs)

    monkeypatch.setattr(backward, "MAX_COLUMNS", 32)
    monkeypatch.setattr(backward, "key_pass", key)
    assert backward.column_pieces(d) == [(0, 32), (32, 32)]
    pieces = ops.backward(q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True)
    assert launches == [((0, 0), (0, d)), ((0, d), (0, 0))]  # dV alone, then dK alone
    assert bool(jnp.all(pieces.delta == whole.delta))
    for name in ("dq", "dk", "dv"):
        ref, got = getattr(whole, name), getattr(pieces, name)
        scale = float(jnp.max(jnp.abs(ref)))
        assert scale > 0 and bool(jnp.all(jnp.isfinite(got))), name
        assert float(jnp.max(jnp.abs(got - ref))) / scale < 1e-6, name


def test_finite_row_amax_ignores_inf_and_nan_bit_for_bit():
    """The dS tile's amax from integer codes: bitwise max |x| over the finite entries of
    each row (0 where a row has none), over 78 decades, signed zeros and denormals."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)) * 10.0 ** rng.integers(-40, 38, (64, 64))
    x = x.astype(np.float32)
    x[3, 5], x[5, 7], x[7, 1], x[10, 3] = np.inf, -np.inf, -3e38, 1e-45
    x[4], x[6], x[8], x[9] = np.nan, np.inf, 0.0, -0.0
    want = np.where(np.isfinite(x), np.abs(x), 0).max(axis=1)
    got = np.asarray(jax.jit(backward._finite_row_amax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_poison_flags_mark_the_kv_heads_with_a_bad_token():
    """The flags that send a CTA's every step down the masked path (which adds the column
    side's poison): per (batch, kv head), over the kv head's query heads for queries."""
    from pallas_kernels.fp8_attention import numerics
    from pallas_kernels.fp8_attention.mosaic_gpu import forward

    b, hq, hkv, tp = 2, 4, 2, 128
    bad = jnp.zeros((b, hq, tp), bool).at[1, 3, 70].set(True)  # query head 3: kv head 1
    rows = (
        jnp.zeros((b, hq, tp // 64, 5, 64))
        .at[..., 4, :]
        .set(numerics.poison(bad).reshape(b, hq, tp // 64, 64))
    )
    flags = backward_ops.query_flags(rows, hkv)
    assert flags.shape == (b, hkv, forward.FLAG_WORDS) and flags.dtype == jnp.int32
    assert np.array_equal(flags[..., 0], [[0, 0], [0, 1]]) and bool(
        jnp.all(flags == flags[..., :1])
    )
    keys = forward.poison_flags(jnp.zeros((b, hkv, 256), bool).at[0, 0, 255].set(True))
    assert np.array_equal(keys[..., 0], [[1, 0], [0, 0]])
    clean, dirty = jnp.bool_(True), jnp.bool_(False)
    assert int(forward.clean_full(clean, 5)) == 5 and int(forward.clean_full(dirty, 5)) == 0
    bounds = forward.clean_document_bounds(dirty, (1, 3, 6, 9))
    assert [int(x) for x in bounds] == [1, 9, 9, 9]  # all steps in the first masked loop
    assert [int(x) for x in forward.clean_document_bounds(clean, (1, 3, 6, 9))] == [1, 3, 6, 9]


def test_ds_range_flags_mark_heads_whose_ds_could_overflow():
    """Only heads whose dO and V decode factors (or |delta|) come near the f32 range keep
    the Inf code in their dS^ cast (every step masked); ordinary inputs never do."""
    import types

    b, hq, hkv, tp = 1, 4, 2, 128
    inv_do = jnp.full((b, hq, tp), 2.0**-20).at[0, 3, 5].set(2.0**94)  # kv head 1
    inv_v = jnp.full((b, hkv, tp), 2.0**3)
    rows = jnp.zeros((b, hq, tp // 64, 5, 64))
    ops_ = types.SimpleNamespace(
        do8=types.SimpleNamespace(inv_tokens=inv_do), v8=types.SimpleNamespace(inv_tokens=inv_v)
    )
    flags = backward_ops.ds_range_flags(ops_, rows)
    assert np.array_equal(flags[..., 0], [[0, 1]])  # 2^94 2^3 >= DS_FACTOR_BOUND
    huge_delta = rows.at[0, 0, 1, 1, 7].set(-(2.0**125))  # kv head 0
    assert np.array_equal(backward_ops.ds_range_flags(ops_, huge_delta)[..., 0], [[1, 1]])
    ops_.do8.inv_tokens = jnp.full((b, hq, tp), 2.0**-20)
    assert not bool(jnp.any(backward_ops.ds_range_flags(ops_, rows)))


@NEEDS_011
def test_passes_run_each_pass_as_the_backward_runs_it():
    """``ops.passes`` (what benchmarks/passes.py and profile_mosaic.py time): every pass
    jits on its own inputs with a non-default backward config (the config's static fields
    stay out of the jitted arguments), and the dK/dV pass gives the backward's dK and dV
    bit for bit (interpret mode)."""
    from pallas_kernels.fp8_attention.mosaic_gpu import ops

    q, k, v, do = _gqa_inputs(13, 1, 128, 2, 1, 64)
    spec = _spec(False, "matched", 64)
    cfg = config.MosaicConfig(
        fused_quantize=False, backward_chained_dots=True, backward_key_registers="k"
    )
    plan = ops.passes(q, k, v, do, spec=spec, config=cfg, interpret=True)
    results = {name: jax.jit(p.fn)(*p.args) for name, p in plan.items()}
    _, dk, dv, _ = results["dkdv_pass"]
    out, lse = ops.forward(q, k, v, spec=spec, config=cfg, interpret=True)
    full = ops.backward(q, k, v, out, lse, do, spec=spec, config=cfg, interpret=True)
    assert float(jnp.max(jnp.abs(full.dk))) > 0
    assert bool(jnp.all(dk[:, :128] == full.dk)) and bool(jnp.all(dv[:, :128] == full.dv))


def test_warpgroup_registers_fill_the_launch_allocation():
    """The consumers' and the producer's setmaxnreg budgets (multiples of 8 in [24, 256])
    fit the 168 registers per thread a 384-thread CTA gets at launch: setmaxnreg cannot
    take more than the CTA holds."""
    from pallas_kernels.fp8_attention.mosaic_gpu import forward

    consumer, producer = forward.CONSUMER_REGISTERS, forward.PRODUCER_REGISTERS
    for n in (consumer, producer):
        assert n % 8 == 0 and 24 <= n <= 256, n
    threads = 128 * (forward.WARPGROUPS + 1)
    at_launch = (65536 // threads) // 8 * 8
    assert forward.WARPGROUPS * 128 * consumer + 128 * producer <= at_launch * threads


@NEEDS_011
def test_kernels_lower_with_the_module_registers():
    """The backward's warp-specialized kernels ask for forward.CONSUMER_REGISTERS in their
    consumers and PRODUCER_REGISTERS in their producer (CUDA lowering)."""
    from pallas_kernels.fp8_attention.mosaic_gpu import forward

    text = _export_backward(EARLY_P_LOWER_CASES[0], with_stats=False)
    assert f"setmaxnreg.inc.sync.aligned.u32 {forward.CONSUMER_REGISTERS};" in text
    assert f"setmaxnreg.dec.sync.aligned.u32 {forward.PRODUCER_REGISTERS};" in text
