"""Gain-drift stress test: plan checks, a run stopped by its time limit and continued by a
second call, the chunk probe on a real checkpoint, and gain_bias on that checkpoint."""

import json
import os

import jax
import numpy as np
import pytest

from dm_jax import diagnostics
from train import metrics
from train.experiments import drift, drift_probe, gain_bias
from train.experiments.hooks import concat_hooks

FLAGS = ["--preset", "tiny", "--arms", "stale,cudnn_fp8", "--seeds", "0"]
FLAGS += ["--steps", "4", "--chunk-steps", "2", "--qk-gain-lr-ratio", "5"]


@pytest.fixture(scope="module")
def drift_dir(tmp_path_factory):
    """A tiny drift test run in two calls: the first stopped by its time limit, the second
    continuing it. The chunk probe is replaced by a cheap stand-in (tested on its own)."""
    out = str(tmp_path_factory.mktemp("drift"))
    stand_in = lambda run_dir, hooks, **kw: {"masking_dce": 0.1, "probe_seconds": 0.0}  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drift_probe, "probe_checkpoint", stand_in)
        mp.setattr(drift.Experiment, "probe_reserve", lambda self: 0.0)
        assert drift.main(FLAGS + ["--minutes", "0.02", "--out", out]) == 0  # stops early
        first_step = drift.Experiment(
            drift.build_parser().parse_args(FLAGS + ["--out", out]),
            drift._plan(drift.build_parser().parse_args(FLAGS + ["--out", out])),
        ).step("stale-s0")
        assert first_step < 4
        assert drift.main(FLAGS + ["--minutes", "5", "--out", out]) == 0
    return out, first_step


def test_drift_continues_across_calls(drift_dir):
    out, first_step = drift_dir
    run_dir = os.path.join(out, "runs", "stale-s0")
    rows = metrics.read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == 4  # no step logged twice
    assert all("L3/max_gain" in r and "L3/top1_share" in r for r in rows)
    probes = [json.loads(line) for line in open(os.path.join(out, "probes", "stale-s0.jsonl"))]
    assert [p["step"] for p in probes] == [2, 4]
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)["run_config"]
    assert saved["optimizer"]["qk_gain_lr_ratio"] == 5.0
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["runs"]["cudnn_fp8-s0"]["status"].startswith("not run")
    assert summary["common_step"] == 4 and os.path.exists(os.path.join(out, "drift.png"))
    assert summary["arms_at_common_step"]["stale"]["masking_dce"] == [0.1]


def test_drift_refuses_other_settings_and_bad_flags(drift_dir, capsys):
    out, _ = drift_dir
    with pytest.raises(SystemExit):
        drift.main(FLAGS[:-2] + ["--qk-gain-lr-ratio", "3", "--out", out])
    assert "--qk-gain-lr-ratio: 5.0 -> 3.0" in capsys.readouterr().err
    for bad, message in (
        (["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
        (["--chunk-steps", "9"], "--chunk-steps: need 1 <= chunk <= --steps"),
        (["--arms", "stale,exact"], "--arms: unknown arm 'exact'"),
    ):
        with pytest.raises(SystemExit):
            drift.main(FLAGS + bad + ["--out", out + "-new"])
        assert message in capsys.readouterr().err


def test_chunk_probe_on_a_checkpoint(drift_dir):
    out, _ = drift_dir
    row = drift_probe.probe_checkpoint(os.path.join(out, "runs", "stale-s0"), concat_hooks())
    assert row["max_gain"] > 1.0 and 0 < row["top1_share"] < 1  # gains moved from 1
    assert np.isfinite(row["masking_dce"]) and np.isfinite(row["val_ce"])
    by_mode = {r["delta"]: r for r in row["residuals"]}
    assert by_mode["matched"]["pre_cast"] < 1e-5 < by_mode["stale"]["pre_cast"]  # cancels
    assert row["residual_ratio_post_mean"] > 1.0  # stale's row sums stay larger after the cast
    assert 0 < row["peakiness_max"] <= 1


def test_attention_peakiness_matches_softmax():
    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    k = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
    peak = np.asarray(diagnostics.attention_peakiness(q, k, causal=True))
    assert peak.shape == (2, 4, 16) and np.allclose(peak[:, :, 0], 1.0)  # one visible key
    logits = np.einsum("bthd,bshd->bhts", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
    logits = np.where(np.tril(np.ones((16, 16), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(peak, (probs / probs.sum(-1, keepdims=True)).max(-1), rtol=1e-5)
    with pytest.raises(ValueError, match="q, k: expected"):
        diagnostics.attention_peakiness(q, k[..., :4])


def test_gain_bias_on_a_drift_checkpoint(drift_dir, tmp_path):
    out, _ = drift_dir
    run_dir = os.path.join(out, "runs", "stale-s0")
    argv = ["--run-dir", run_dir, "--arms", "stale", "--batches", "2", "--no-projections"]
    assert gain_bias.main(argv + ["--out", str(tmp_path)]) == 0
    result = json.load(open(tmp_path / "gain_bias.json"))
    assert result["setup"]["weights"] == "checkpoint step 4" and result["setup"]["data_start"] == 4
    gains = result["weight_gains"]["L3"]
    assert max(gains["g_q"] + gains["g_k"]) > 1.0  # the trained gains, not the init
    assert result["arms"]["stale"]["gains"]["corr_push_product"] is not None


def test_gap_plot_sets_arm_gaps_against_seed_gaps(tmp_path):
    def run(arm, seed, gains):
        run_dir = tmp_path / f"{arm}-s{seed}"
        run_dir.mkdir()
        rows = [{"step": 10 * (i + 1), "L3/max_gain": g} for i, g in enumerate(gains)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return dict(arm=arm, seed=seed, seed_index=seed, run_dir=str(run_dir), probes=[])

    runs = {
        "stale-s0": run("stale", 0, [1.0, 1.2, 1.4]),
        "matched-s0": run("matched", 0, [1.0, 1.1, 1.2]),
        "matched-s1": run("matched", 1, [1.0, 1.15, 1.25]),
    }
    assert drift_probe.plot_gaps({"stale-s0": runs["stale-s0"]}, str(tmp_path)) is None
    path = drift_probe.plot_gaps(runs, str(tmp_path))
    assert path.endswith("gaps.png") and os.path.getsize(path) > 0


def test_report_reads_the_step_of_a_run_copied_without_checkpoints(drift_dir, tmp_path):
    import shutil

    out, _ = drift_dir
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoints"))
    args = drift.build_parser().parse_args(FLAGS + ["--out", copy])
    exp = drift.Experiment(args, drift._plan(args))
    assert exp.step("stale-s0") == 0 and exp.reported_step("stale-s0") == 4
    assert drift.summarize(exp)["runs"]["stale-s0"]["status"] == "done"
