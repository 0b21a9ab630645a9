"""The GPU scripts under benchmarks/ run end to end on the CPU (interpret mode, tiny
shapes), so a GPU call never fails on a script error; the cuDNN probe's analysis is run
against the stand-in kernel with the semantics measured on the H200."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import (
    chunk_local_speed,
    correctness,
    cudnn_fp8_probe,
    ds_scale_errors,
    fp8_linear,
    memory_calibration,
    ncu_hotspots,
    passes,
    quantize_speed,
    recurrence_profile,
    recurrence_speed,
)


def test_correctness_script_quick(tmp_path):
    assert (
        correctness.main(
            ["--quick", "--implementation", "pallas_interpret", "--out", str(tmp_path)]
        )
        == 0
    )
    records = json.load(open(tmp_path / "correctness.json"))["records"]
    by_mode = {r["delta"]: r for r in records if r["case"] == "smoke"}
    assert set(by_mode) == {"matched", "do_matched", "stale"} and all(r["finite"] for r in records)
    assert {r["backward"] for r in records} == {"triton_interpret"}  # the kernels that ran
    assert by_mode["matched"]["pre_max"] < 1e-5
    assert by_mode["matched"]["pre_max_multikey"] <= by_mode["matched"]["pre_max"]
    # do_matched removes dO's rounding from the residual, stale does not: the median drops
    assert (
        by_mode["matched"]["pre_median"]
        < by_mode["do_matched"]["pre_median"]
        < by_mode["stale"]["pre_median"]
    )
    assert max(r["ref_dq"] for r in records) < 1e-5  # kernels == emulation on the CPU


@pytest.mark.parametrize("causal", [False, True])
def test_visible_keys_counts_what_each_query_sees(causal):
    """The checker's count behind ``pre_max_multikey`` (rows that see two keys or more),
    against a direct count: causality, segment borders shifted per batch row, T != S."""
    import numpy as np

    from pallas_kernels.fp8_attention.arg_specs import Case

    case = Case("v", b=2, t=300, s=260, hq=2, hkv=1, dqk=64, dv=64, causal=causal, segment_len=70)
    got = np.asarray(correctness.visible_keys(case, chunk=128))
    q_ids, kv_ids = (np.asarray(x) for x in case.segment_ids())
    seen = q_ids[:, :, None] == kv_ids[:, None, :]
    if causal:
        seen &= np.arange(case.s)[None, None, :] <= np.arange(case.t)[None, :, None]
    np.testing.assert_array_equal(got, seen.sum(-1))
    assert (got == 1).any() == causal  # a segment's first token sees one key when causal


@pytest.mark.parametrize("causal", [False, True])
def test_f32_reference_in_head_slices_equals_the_whole(causal):
    # the checker slices its f32 attention over kv heads when the logits would not fit
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, do = (jax.random.normal(key, (1, 64, 8, 32)) for key in ks[:2])
    k, v = (jax.random.normal(key, (1, 64, 4, 32)) for key in ks[2:])
    ids = jnp.repeat(jnp.arange(2), 32)[None]
    whole = correctness.f32_out_and_grads(q, k, v, do, causal, ids)
    sliced = correctness.f32_out_and_grads(q, k, v, do, causal, ids, logit_bytes=1)
    for a, b in zip(whole, sliced):
        assert a.shape == b.shape
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_timing_loop_keeps_every_column_chunk_of_an_output():
    """A pass whose output joins two column chunks: the timed loop still computes the
    second (XLA drops what nothing reads; a loop that read only the first element let it
    drop the second 128-column launch of a head dim 256 pass)."""

    def two_chunks(x):  # the second chunk alone takes a cosine
        return jnp.concatenate([x * 2.0, jnp.cos(x)], axis=-1)

    x = jnp.ones((2, 8, 4), jnp.float32)
    loop, leaves = passes.timing_loop(two_chunks, (x,), 2)
    hlo = jax.jit(loop).lower(leaves).compile().as_text()
    assert "cosine" in hlo


def test_passes_script_smoke(tmp_path):
    passes.main(
        [
            "--smoke",
            "--iters",
            "1",
            "--reps",
            "1",
            "--modes",
            "precise,fast",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.load(open(tmp_path / "passes.json"))["rows"]
    names = {r["name"] for r in rows if "ms" in r}
    assert not [r for r in rows if "error" in r]
    assert {"forward_kernel", "delta_matched_kernel", "dq_pass", "dkdv_pass"} <= names
    assert {(r["precision"], r["mode"]) for r in rows} == {
        ("fp8", "precise"),
        ("fp8", "fast"),
        ("bf16", "precise"),
    }


def test_cudnn_probe_recovers_the_measured_key_mapping(monkeypatch):
    """Against a stand-in with the H200's semantics, the sensitivity analysis reads each
    output scale key off as scaling the tensor it really scales (log2 change 2 = x4; less
    where the base value sits in E4M3's subnormal range, as dQ does here)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from tests.test_nn_attention import _fake_cudnn_fp8

    monkeypatch.setattr(fa, "dot_product_attention", _fake_cudnn_fp8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    out = cudnn_fp8_probe.sensitivity(False, shape=(1, 128, 2, 128))
    per_key = out["per_key"]  # columns: max dq8, dk8, dv8, amax dQ, dK, dV, dP
    for key, column in (("scale_dK", 0), ("scale_dV", 1), ("scale_dP", 2)):
        changes = per_key[key][:3]
        assert changes[column] > 1.0 and sum(abs(c) for c in changes) == changes[column], key
    assert per_key["descale_o"][2] == pytest.approx(2.0, abs=0.05)
    assert out["base_minus_true_log2"][3] == pytest.approx(-8.0, abs=0.1)  # amax_dQ: dS times 1/256


def test_attention_benchmark_smoke(tmp_path):
    """Every shape of the speed benchmark builds; our arms time and score, cuDNN's fail
    with a recorded reason on a CPU."""
    from benchmarks import attention

    attention.main(
        [
            "--smoke",
            "--shapes",
            "gqa32_8,d192_128,h569m_t4096_docs",
            "--causal",
            "1",
            "--iters",
            "1",
            "--reps",
            "1",
            "--arms",
            "ours_fp8_matched,cudnn_bf16,cudnn_bf16_packed",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.load(open(tmp_path / "benchmarks.json"))["rows"]
    ours = [r for r in rows if r["arm"] == "ours_fp8_matched"]
    assert [r["case"] for r in ours] == ["gqa32_8", "d192_128", "h569m_t4096_docs"]
    for r in ours:  # (the documents case: against f32 attention over the same documents)
        assert r["fwd_tflops"] > 0 and r["fwdbwd_ms"] > 0 and r["err"]["dq"] < 0.1
    if jax.default_backend() != "gpu":
        assert all("error" in r for r in rows if r["arm"].startswith("cudnn_bf16"))


def test_kernel_ir_capture_and_census():
    """The offline PTX census: TTIR of every kernel is captured on a CPU host (the compile
    step needs the triton package and is not run here), and the counter reads PTX."""
    from benchmarks import kernel_ir

    modules, _ = kernel_ir.capture_ttir("fp8", "fast", head_dim=64, tokens=128)
    assert sorted(modules) == [
        "dm_fp8_attention_dkdv_accfast",
        "dm_fp8_attention_dq_accfast",
        "dm_fp8_attention_forward_accfast",
        "dm_fp8_attention_matched_delta_accfast",
    ]
    assert all("tt.dot" in m for m in modules.values())
    ptx = (
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {..};\n" * 2
        + "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {..};\nprmt.b32 %r1;\nbar.sync 0;\n"
        + "atom.global.gpu.acq_rel.add.v4.f32 %r2, [%rd1], {..};\n"
    )
    counts = kernel_ir.census(ptx)
    assert counts["wgmma"] == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 2}
    assert counts["mma.sync"] == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 1}
    assert counts["prmt"] == {"prmt.b32": 1} and counts["bar"] == {"bar.sync": 1}
    assert counts["atom"] == {"atom.global.gpu.acq_rel.add.v4.f32": 1} and "red" not in counts


def test_tune_accumulation_set_smoke(tmp_path):
    """`tune.py --set accumulation` times every mode, causal and not, and runs the accuracy
    study (interpret mode: every mode computes the same numbers, so vs_precise is 0)."""
    from benchmarks import tune

    tune.main(["--smoke", "--set", "accumulation", "--out", str(tmp_path)])
    res = json.load(open(tmp_path / "tune_accumulation.json"))
    assert [r["variant"] for r in res["timing"]] == ["precise", "promote32", "fast"] * 2
    assert all("fwdbwd_ms" in r and "fwd_ms" in r for r in res["timing"])
    acc = res["accuracy_vs_t"]
    assert [r["mode"] for r in acc] == ["precise", "promote32", "fast"]
    assert all(r["pre_max"] < 1e-5 and r["hp_dq"] < 0.1 for r in acc)
    assert all(r["vs_precise_dq"] == 0.0 for r in acc[1:])


def test_tune_block_variants_are_valid():
    """Every variant (tiles, Triton launch settings) the GPU sweeps would time is one the
    Triton backend accepts for its head dim (no variant fails on a shape rule on the GPU)."""
    from benchmarks import tune
    from dm_jax import backends
    from pallas_kernels.fp8_attention.api import AttentionSpec

    triton = backends.get("triton")
    for which in ("blocks", "heads"):
        for case, name, var, with_fwd, with_bwd in tune.plan(which, smoke=False):
            q = jax.ShapeDtypeStruct((case.b, case.t, case.hq, case.dqk), jnp.bfloat16)
            v = jax.ShapeDtypeStruct((case.b, case.s, case.hkv, case.dv), jnp.bfloat16)
            spec = AttentionSpec(case.causal, "matched", "fp8", 0.1, var.tiles)
            reason = triton.supported(q, q, v, spec, var.config)
            assert reason is None, (case.name, name, reason)
            assert with_fwd or with_bwd


def test_fp8_linear_script_tiny(tmp_path, monkeypatch):
    # The train_step rows compile a whole model four times (an f32 reference and three
    # variants): the tiny preset with one layer of each kind (GDN, attention) instead of its
    # 3 + 1 still runs every FP8 projection the step quantizes, and compiles a third faster.
    one_of_each = functools.partial(fp8_linear.preset, pattern=("gdn", "attn"))
    monkeypatch.setattr(fp8_linear, "preset", one_of_each)
    assert fp8_linear.main(["--size", "tiny", "--reps", "1", "--out", str(tmp_path)]) == 0
    result = json.load(open(tmp_path / "fp8_linear.json"))
    ffn = {r["variant"]: r for r in result["ffn"]}
    assert result["causality_ok"] and set(ffn) == {"per_token", "per_tensor", "bf16"}
    assert ffn["bf16"]["err_y"] < ffn["per_token"]["err_y"] < 0.15  # FP8 rounding, not noise
    assert all(r["ms"] > 0 and r["err_grad"] < 1 for r in result["train_step"])


def test_ncu_hotspots_reads_the_source_page_and_finds_the_loop(tmp_path, capsys):
    """A source page as ncu writes it (a kernel-name line, then the table): the hottest
    instruction, the opcode shares and the main loop (the most executed instructions)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    header += ["stall_barrier", "stall_wait"]
    rows = [
        ["0x10", "  LDC R1, c[0x0][0x28]", "5", "8", "0", "5"],
        ["0x20", "  FFMA R2, R3, R4, R5", "30", "640", "0", "30"],
        ["0x30", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "50", "640", "50", "0"],
        ["0x40", "@!P1  BRA 0x80", "15", "320", "0", "15"],
    ]
    lines = ['"Kernel Name","k",\n'] + [
        ",".join(f'"{c}"' for c in r) + "\n" for r in [header] + rows
    ]
    path = tmp_path / "page.csv"
    path.write_text("".join(lines))
    ncu_hotspots.main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "4 instructions, 100 samples" in out
    assert "50.0%  0x30" in out and "30.0%  0x20" in out  # hottest first
    assert "main loop: 2 instructions per iteration" in out and "80.0% of the samples" in out
    assert "62.5%  stall_barrier" in out and "per iteration: FFMA 1, WARPGROUP 1" in out


def test_quantize_speed_script_smoke(tmp_path):
    """The quantize pre-passes per warps setting (interpret mode): every setting writes the
    same operands, and each row names its pass and its bytes' rate."""
    assert quantize_speed.main(["--smoke", "--warps", "4,8", "--out", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "quantize_speed.json"))["rows"]
    assert [(r["warps"], r["name"]) for r in rows] == [
        (4, "forward_quantize"),
        (4, "backward_quantize"),
        (8, "forward_quantize"),
        (8, "backward_quantize"),
    ]
    assert all(r["bitwise_same_as_first"] and r["gb_per_s"] > 0 for r in rows)


def test_recurrence_speed_script_tiny(tmp_path):
    """Each state pass times and matches the first variant at the tiny shape; variants past
    the time budget are skipped and say so (the reference always runs)."""
    argv = ["--shape", "tiny", "--iters", "1", "--reps", "1", "--out", str(tmp_path)]
    names = ["sequential", "associative", "unroll4", "pallas"]  # pallas: interpret mode here
    variants = ["--chunks", "8", "--variants", ",".join(names)]
    assert recurrence_speed.main(argv + variants) == 0
    result = json.load(open(tmp_path / "recurrence_speed_tiny.json"))
    assert result["reference"] == "sequential C=8"
    assert [r["variant"] for r in result["rows"]] == names
    for r in result["rows"]:
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["max_abs_o"] > 1e-2
        assert max(r["diff_o"], r["diff_state"], r["diff_grads"]) < 1e-5
    layouts = ["--chunks", "8", "--loss", "gated_norm"]
    layouts += ["--variants", "sequential,pallas,pallas_chunk_outputs"]
    assert recurrence_speed.main(argv + layouts) == 0
    result = json.load(open(tmp_path / "recurrence_speed_tiny.json"))
    assert result["loss"] == "gated_norm" and len(result["rows"]) == 3
    assert all(max(r["diff_o"], r["diff_state"], r["diff_grads"]) < 1e-5 for r in result["rows"])
    skipped = ["--chunks", "16", "--variants", "sequential,unroll16", "--budget", "0"]
    assert recurrence_speed.main(argv + skipped) == 0
    rows = json.load(open(tmp_path / "recurrence_speed_tiny.json"))["rows"]
    assert rows[0]["diff_o"] == 0 and rows[1] == dict(
        chunk=16, variant="unroll16", error="skipped: time budget"
    )


def test_chunk_local_speed_script_tiny(tmp_path):
    """The chunk-local stage, XLA and the kernels (interpret mode), timed and checked
    against full-precision XLA; the chunk-local variant of recurrence_speed matches, and
    sizes the kernels refuse are skipped with the reason."""
    argv = ["--shape", "tiny64", "--chunk", "16", "--doc-len", "13", "--iters", "1", "--reps", "1"]
    assert chunk_local_speed.main(argv + ["--out", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "chunk_local_speed.json"))["rows"]
    assert [r["form"] for r in rows] == ["xla", "pallas", "pallas backward kernels alone"]
    assert all(r["fwdbwd_ms"] > 0 for r in rows)
    assert max(max(r["err_operands"], r["err_grads"]) for r in rows[:2]) < 1e-5
    argv = ["--shape", "tiny", "--iters", "1", "--reps", "1", "--out", str(tmp_path)]
    argv += ["--chunks", "8,16", "--variants", "sequential,pallas_chunk_local"]
    assert recurrence_speed.main(argv) == 0
    rows = json.load(open(tmp_path / "recurrence_speed_tiny.json"))["rows"]
    assert rows[1]["error"].startswith("skipped: chunk-local kernels need 16 <= C")
    assert max(rows[3]["diff_o"], rows[3]["diff_grads"]) < 1e-5  # C = 16 runs


def test_recurrence_profile_script_tiny(tmp_path):
    """Per-stage device time of two solvers at the tiny shape; their gradients agree."""
    argv = ["--shape", "tiny", "--iters", "1", "--reps", "1", "--steps", "1"]
    argv += ["--variants", "sequential,pallas_doubling", "--out", str(tmp_path)]
    assert recurrence_profile.main(argv) == 0
    rows = json.load(open(tmp_path / "recurrence_profile_tiny.json"))["rows"]
    assert [r["variant"] for r in rows] == ["sequential", "pallas_doubling"]
    for r in rows:
        assert r["fwdbwd_ms"] > 0 and r["diff_grads"] < 1e-5
        assert r["by_stage_ms"].get("solve/fwd", 0) > 0  # the stages are named in the trace


def test_memory_calibration_reads_a_run(tmp_path, capsys):
    """The estimate of the step a run dir trained, beside the peak its summary recorded."""
    from train import config as config_lib

    run = tmp_path / "run"
    run.mkdir()
    cfg = config_lib.parse_args(["--preset", "tiny", "--batch-size", "2", "--run-dir", str(run)])
    cfg.save(str(run))
    (run / "summary.json").write_text(json.dumps(dict(peak_device_bytes=2e9, tokens_per_s=9.0)))
    assert (
        memory_calibration.main([str(run), str(tmp_path / "missing"), "--out", str(tmp_path)]) == 0
    )
    (row,) = json.load(open(tmp_path / "memory_calibration.json"))
    assert row["preset"] == "gdn_gqa-tiny" and row["peak_gb"] == 2.0
    assert row["ratio"] == row["estimate_gb"] / 2.0 and "| run |" in capsys.readouterr().out


def test_document_tiles_script_shapes_are_packed_self_attention():
    """benchmarks/document_tiles.py (the H200's bit-for-bit check; the interpret-mode one
    is tests/test_mosaic_backward.py) compares shapes with documents and T = S."""
    from benchmarks import document_tiles

    for case in document_tiles.SHAPES.values():
        assert case.segment_len and case.t == case.s and case.segment_len < case.t
        q_ids, kv_ids = case.segment_ids()
        assert bool(jnp.array_equal(q_ids, kv_ids))


def test_layer_kernels_adds_up_stream_kernels_by_kind():
    """benchmarks/layer_kernels.py: kernels of several steps summed per kind, per step, and
    the last step's launches in order."""
    from benchmarks.layer_kernels import breakdown

    one_step = [
        ("dm_fp8_attention_quantize", 20.0),
        ("dm_fp8_attention_forward_mosaic_mosaic_gpu_kernel", 300.0),
        ("dm_fp8_attention_query_pass_mosaic_mosaic_gpu_kernel", 160.0),
        ("dm_fp8_attention_key_pass_mosaic_mosaic_gpu_kernel", 590.0),
        ("loop_pad_fusion", 10.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 200.0),
    ]
    events = [dict(name=n, dur=d * (1 + step)) for step in range(2) for n, d in one_step]
    got = breakdown(events, steps=2)
    assert got["us_by_kind"] == {
        "key pass (dK, dV)": 885.0,
        "forward kernel": 450.0,
        "cuDNN": 300.0,
        "query passes (delta, dQ)": 240.0,
        "quantize pre-passes": 30.0,
        "XLA kernels and copies": 15.0,
    }
    assert got["kernel_us"] == 1920.0 and got["launches_per_step"] == 6
    assert [x["us"] for x in got["launches"]] == [2 * d for _, d in one_step]


def test_cta_overhead_fit_recovers_the_fixed_and_per_step_costs():
    """benchmarks/cta_overhead.py: the CTA counts of its equal-work shapes, and the fit of
    time = CTAs / SMs x (once + per_step x steps) recovering known costs (and failing to
    fit times that do not follow it: a visible residual)."""
    from benchmarks import cta_overhead
    from pallas_kernels.fp8_attention.arg_specs import Case

    case = Case("T512", 256, 512, 512, 16, 16, 128, 128)
    assert cta_overhead.cta_counts(case, 128, 128) == (256 * 16 * 4, 4)
    assert cta_overhead.cta_counts(case, 128, 64) == (256 * 16 * 4, 8)
    rows = [
        dict(ctas=c, steps=s, ms=c / 132 * (2.8 + 1.9 * s) / 1e3)
        for c, s in ((16384, 4), (8192, 8), (4096, 16), (2048, 32))
    ]
    got = cta_overhead.fit(rows, 132)
    assert got["once_us"] == pytest.approx(2.8) and got["per_step_us"] == pytest.approx(1.9)
    assert got["worst_rel_residual"] < 1e-9
    rows[0]["ms"] *= 1.5
    assert cta_overhead.fit(rows, 132)["worst_rel_residual"] > 0.05


def test_key_pass_variants_patch_the_backward_only_inside_their_block():
    """benchmarks/key_pass_variants.py: ``masked_documents`` swaps the backward's document
    loops for one masked loop over the same steps (in order), and puts them back after."""
    from benchmarks import key_pass_variants
    from pallas_kernels.fp8_attention.mosaic_gpu import backward

    original = backward.document_loops
    with key_pass_variants.patched("masked_documents"):
        assert backward.document_loops is key_pass_variants.masked_loops
    assert backward.document_loops is original
    with key_pass_variants.patched("pieces64"):  # a config variant: nothing patched
        assert backward.document_loops is original

    seen = jax.jit(  # fori_loop traces the step once: record its flag, run the indices
        lambda: key_pass_variants.masked_loops(
            lambda j, c, masked: c.at[j].set(j + 100 * masked), (2, 3, 5, 7), jnp.zeros(8, int)
        )
    )()
    assert seen.tolist() == [0, 0, 102, 103, 104, 105, 106, 0]


def test_ds_scale_errors_script_tiny(tmp_path, monkeypatch):
    """Every dS^ scaling on the Triton twin at a tiny causal GQA shape: dV equal (it comes
    before dS's cast), dK equal for per-row scales over 64 or 128 keys (its per-key scales
    span the tile's 64 queries either way), dQ equal for dK scales over 64 or 128 queries,
    dQ and dK at FP8 error against f32 for each."""
    monkeypatch.setattr(ds_scale_errors, "CASES", {"tiny": (1, 96, 2, 1, 64, True, True)})
    argv = ["--implementation", "pallas_interpret", "--modes", "matched", "--out", str(tmp_path)]
    assert ds_scale_errors.main(argv) == 0
    rows = json.load(open(tmp_path / "ds_scale_errors.json"))["rows"]
    assert [r["ds_scale"] for r in rows] == ["rows", "tile", "rows_k128", "rows_q128_k128"]
    assert rows[0]["dv_fro"] == rows[1]["dv_fro"] == rows[2]["dv_fro"]
    assert rows[0]["dk_fro"] == rows[2]["dk_fro"]
    assert rows[2]["dq_fro"] == rows[3]["dq_fro"]  # 128 queries per dK scale: dQ's unchanged
    assert all(0 < r[f] < 0.3 for r in rows for f in ("dq_fro", "dk_fro"))
