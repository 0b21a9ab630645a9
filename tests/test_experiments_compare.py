"""The comparison runner end to end on the tiny model (CPU): train, evaluate, report."""

import json
import math
import os

from train.experiments import compare, presets


def test_arms_share_everything_but_the_attention_arm(tmp_path):
    args = compare.build_parser().parse_args(["--out", str(tmp_path), "--no-qk-norm"])
    preset = presets.get_preset("tiny")
    a, b = (
        compare.make_run_config(args, preset, arm, 3, str(tmp_path / arm))
        for arm in ("stale", "matched")
    )
    da, db = a.compat_dict(), b.compat_dict()
    assert dict(da["model"].pop("overrides"))["attention"] == "stale"
    assert dict(db["model"].pop("overrides"))["attention"] == "matched"
    assert da == db and a.seed == b.seed == 0
    assert a.model_config.qk_norm is False and b.model_config.qk_norm is False


def test_tiny_comparison_end_to_end_with_packed_documents(tmp_path):
    """Two arms (one cannot run on a CPU) over documents packed with segment ids: training,
    every evaluation (greedy RULER decoding included), the report and its plots."""
    out = str(tmp_path / "out")
    argv = [
        "--preset",
        "tiny",
        "--arms",
        "matched,cudnn_fp8",
        "--steps",
        "2",
        "--packing",
        "segments",
        "--out",
        out,
        "--runs-dir",
        str(tmp_path / "runs"),
        "--no-progress",
    ]
    assert compare.main(argv) == 0
    cudnn = json.load(open(os.path.join(out, "results", "cudnn_fp8.json")))
    assert cudnn["status"] == "not run" and "GPU" in cudnn["reason"]
    r = json.load(open(os.path.join(out, "results", "matched.json")))
    assert r["status"] == "done" and r["steps"] == 2 and not r["errors"], r
    assert 0 < r["val_ce"] < math.log(257) + 1 and 0 < r["train_ce"] < math.log(257) + 1
    assert r["tokens_per_s"] > 0
    layers = [str(i) for i in (3,)]  # the tiny hybrid: GDN, GDN, GDN, attention
    assert sorted(r["gains"]) == layers and r["gains"]["3"]["max_gain"] > 0
    assert r["masking"]["layer"] == 3 and math.isfinite(r["masking"]["increase"])
    modes = {(x["layer"], x["delta"]): x for x in r["residuals"]}
    assert set(modes) == {(3, d) for d in ("stale", "do_matched", "matched")}
    assert modes[(3, "matched")]["pre_cast"] < 1e-5 < modes[(3, "stale")]["pre_cast"]
    assert r["residual_ratio_post"]["3"] > 1
    assert {(s["task"], s["context_length"]) for s in r["ruler"]} == {
        (t, 512) for t in presets.PRESETS["tiny"].ruler.tasks
    }
    assert all(0 <= s["exact_match"] <= 1 and s["gold_logprob"] < 0 for s in r["ruler"])
    text = open(os.path.join(out, "report.md")).read()
    assert "| matched | done | 2 |" in text and "| cudnn_fp8 | not run |" in text
    assert "segments packing" in text
    assert all(
        os.path.exists(os.path.join(out, p)) for p in ("loss.png", "max_gain.png", "top_share.png")
    )


def test_small_preset_is_ready_for_a_gpu(tmp_path):
    """Without training: every default arm gets a valid config, the shapes suit cuDNN FP8
    (head dim 128, sequence a multiple of 128) and the long-context prompts fit."""
    from train.data import ByteTokenizer
    from train.eval import build_haystack, generate

    args = compare.build_parser().parse_args(["--out", str(tmp_path)])
    preset = compare._preset(args)
    for arm in presets.DEFAULT_ARMS:
        cfg = compare.make_run_config(args, preset, arm, 100, str(tmp_path / arm))
        assert cfg.attention == arm and cfg.model_config.head_dim == 128 and cfg.seq_len % 128 == 0
    tok, hay = ByteTokenizer(), build_haystack()
    for length in preset.ruler.context_lengths:
        for task in preset.ruler.tasks:
            (ex,) = generate(task, length, 1, haystack=hay, tokenizer=tok)
            assert len(tok.encode(ex.prompt + ex.target)) <= length
