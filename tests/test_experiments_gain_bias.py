"""Gain-gradient bias: the statistics on synthetic gradients, and the CLI end to end on a
tiny model (reference against itself is exactly unbiased, stale and matched differ)."""

import json
import os

import numpy as np
import pytest

from train.experiments import bias_stats, gain_bias


def test_channel_bias_finds_a_planted_bias_and_not_noise():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(400, 64))
    noisy = ref + 0.1 * rng.normal(size=ref.shape)  # arm = reference + zero-mean noise
    biased = noisy + np.where(np.arange(64) < 8, -0.05, 0.0)  # 8 channels pushed up
    clean = bias_stats.summarize(bias_stats.channel_bias(noisy, ref))
    planted = bias_stats.summarize(bias_stats.channel_bias(biased, ref))
    assert clean["share_abs_t_gt_3"] < 0.05 and abs(clean["sign_agreement"] - 0.5) < 0.03
    assert planted["share_abs_t_gt_3"] == pytest.approx(8 / 64, abs=1 / 64)
    assert planted["upward_share"] == 1.0 and planted["sign_agreement"] > clean["sign_agreement"]
    assert planted["bias_norm"] > 3 * clean["bias_norm"]
    # The Adam step bias is |bias| / rms(reference gradient): about 0.05 on the planted channels.
    assert planted["adam_step_bias_max"] == pytest.approx(0.05, rel=0.3)
    # Streaming moments give the same numbers as the stored batches.
    moments = bias_stats.Moments()
    for a, r in zip(biased, ref):
        moments.add(a, r)
    stored, streamed = bias_stats.channel_bias(biased, ref), moments.channels()
    for key in streamed:
        np.testing.assert_allclose(streamed[key], stored[key], rtol=1e-8, atol=1e-12)


def test_summary_edge_cases_and_bad_input():
    ref = np.random.default_rng(1).normal(size=(5, 4))
    same = bias_stats.summarize(bias_stats.channel_bias(ref, ref), product=np.ones(4))
    assert same["bias_norm"] == 0 and same["share_abs_t_gt_3"] == 0
    assert same["sign_agreement"] is None and same["upward_share"] is None
    assert same["corr_push_product"] is None  # constant gains: no large-gain channel
    assert bias_stats.correlation([1, 2, 3], [2, 4, 7]) > 0.9
    with pytest.raises(ValueError, match="need >= 2 batches"):
        bias_stats.channel_bias(ref[:1], ref[:1])
    with pytest.raises(ValueError, match=r"arm_NC, ref_NC"):
        bias_stats.channel_bias(ref, ref[:, :3])


def test_gain_bias_cli_tiny(tmp_path, capsys):
    out = tmp_path / "bias"
    argv = ["--preset", "gqa-tiny", "--arms", "reference,stale,matched,cudnn_fp8"]
    argv += ["--batches", "3", "--batch-size", "1", "--seq-len", "32", "--out", str(out)]
    assert gain_bias.main(argv) == 0
    result = json.loads((out / "gain_bias.json").read_text())
    assert set(result) >= {"arms", "contrasts", "stale_over_matched", "setup", "weight_gains"}
    arms = result["arms"]
    assert set(arms) == {"reference", "stale", "matched", "cudnn_fp8"}
    assert arms["cudnn_fp8"]["status"] == "not run" and "GPU" in arms["cudnn_fp8"]["reason"]
    ref = arms["reference"]
    assert ref["status"] == "done" and ref["gains"]["bias_norm"] == 0.0
    assert ref["projections"]["bias_norm"] == 0.0 and ref["gains"]["share_abs_t_gt_3"] == 0.0
    for arm in ("stale", "matched"):
        gains = arms[arm]["gains"]
        assert (
            gains["bias_norm"] > 0 and gains["noise_norm"] > 0 and gains["channels"] == 4 * 2 * 16
        )
        layer = arms[arm]["layers"]["L0"]
        assert set(layer) == {"q", "k", "channels"}
        assert len(layer["channels"]["q"]["bias"]) == len(layer["channels"]["k"]["se"]) == 16
        assert arms[arm]["projections_by_matrix"] and os.path.exists(out / f"gain_bias_{arm}.png")
    # Stale and matched differ (their delta differs), so does their bias.
    stale_bias = np.asarray(arms["stale"]["layers"]["L0"]["channels"]["q"]["bias"])
    matched_bias = np.asarray(arms["matched"]["layers"]["L0"]["channels"]["q"]["bias"])
    assert not np.allclose(stale_bias, matched_bias)
    assert result["contrasts"]["stale-matched"]["bias_norm"] > 0
    assert result["stale_over_matched"]["gains"] == pytest.approx(
        arms["stale"]["gains"]["bias_norm"] / arms["matched"]["gains"]["bias_norm"]
    )
    assert "stale / matched bias norm" in capsys.readouterr().out


def test_gain_bias_cli_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gain_bias.main(["--preset", "tiny", "--arms", "stale,exact", "--out", str(tmp_path)])
    assert "--arms: unknown arm 'exact'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gain_bias.main(["--preset", "tiny", "--batches", "1", "--out", str(tmp_path)])
    assert "--batches: need >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gain_bias.main(["--out", str(tmp_path)])
    assert "--run-dir: give a run directory" in capsys.readouterr().err
