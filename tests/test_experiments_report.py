"""Report, arm availability and time budget of the comparison runner (no training here)."""

import signal
import time

import pytest

from train.experiments import budget, presets, report


def _done(arm, gain, ratio):
    return dict(
        arm=arm,
        status="done",
        reason=None,
        steps=10,
        train_ce=2.5,
        val_ce=2.6,
        tokens_per_s=1234.0,
        train_seconds=5.0,
        eval_seconds=1.0,
        gains={"3": dict(max_gain=gain, top1_share=0.5, top4_share=0.9)},
        masking=dict(layer=3, ce=2.6, ce_masked=2.9, increase=0.3),
        residuals=[
            dict(layer=3, delta=d, pre_cast=p, post_cast=10 * p)
            for d, p in (("stale", 6e-3), ("matched", 1e-8))
        ],
        residual_ratio_post={"3": ratio},
        ruler=[
            dict(
                task="niah_single",
                context_length=512,
                n=2,
                exact_match=0.5,
                partial_match=0.5,
                gold_logprob=-1.25,
                margin=0.75,
                choice=1.0,
            )
        ],
        ruler_summary={
            "512": dict(
                exact_match=0.5, partial_match=0.5, gold_logprob=-1.25, margin=0.75, choice=1.0
            )
        },
    )


def test_cudnn_arms_are_not_run_on_cpu():
    assert "GPU" in presets.unavailable_reason("cudnn_fp8", backend="cpu")
    assert presets.unavailable_reason("cudnn_bf16", backend="gpu") is None
    assert presets.unavailable_reason("stale", backend="cpu") is None
    assert "--packing concat" in presets.unavailable_reason(
        "cudnn_fp8", backend="gpu", packing="segments"
    )
    assert presets.unavailable_reason("cudnn_bf16", backend="gpu", packing="segments") is None
    with pytest.raises(ValueError, match="--arms"):
        presets.unavailable_reason("fp4")


def test_report_has_a_row_per_arm_and_the_not_run_reason(tmp_path):
    results = [
        _done("stale", 5.4, 5.8),
        _done("matched", 1.2, 6.1),
        dict(
            arm="cudnn_fp8", status="not run", reason=presets.unavailable_reason("cudnn_fp8", "cpu")
        ),
    ]
    path = report.write_report(
        str(tmp_path / "report.md"),
        results,
        title="T",
        setup=["seed 0"],
        plots={"loss": str(tmp_path / "loss.png")},
    )
    text = open(path).read()
    summary = text.split("## Summary")[1].split("\n\n")[1].splitlines()
    assert summary[0].startswith(
        "| arm | status | steps | train CE | val CE | RULER-512 EM / logprob / margin"
    )
    rows = {r.split("|")[1].strip(): r for r in summary[2:]}
    assert set(rows) == {"stale", "matched", "cudnn_fp8"}
    assert (
        "| 5.400 |" in rows["stale"]
        and "| 5.80 |" in rows["stale"]
        and "0.500 / -1.250 / 0.750" in rows["stale"]
    )
    assert "not run" in rows["cudnn_fp8"] and "| - |" in rows["cudnn_fp8"]
    assert "**not run**: needs an NVIDIA GPU" in text
    assert "![loss](loss.png)" in text and "6.00e-03 / 6.00e-02" in text
    assert "2.6000 -> 2.9000 (+0.3000)" in text


def test_steps_for_budget():
    cal = budget.Calibration(seconds_per_step=0.5, setup_seconds=20.0)
    # 4 min budget, 60 s for evaluation, 20 s set-up: 160 s of steps at 0.5 s -> 320, times the margin.
    assert budget.steps_for_budget(cal, 240, reserve_s=60, margin=1.0) == 320
    assert budget.steps_for_budget(cal, 240, reserve_s=60) == int(0.85 * 320)
    with pytest.raises(ValueError, match="--minutes-per-arm"):
        budget.steps_for_budget(cal, 60, reserve_s=50)


def test_time_limit_sends_sigint_once():
    got = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        with budget.TimeLimit(0.05) as limit:
            time.sleep(0.3)
        with budget.TimeLimit(None) as never:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, old)
    assert limit.fired and not never.fired and got == [1]
