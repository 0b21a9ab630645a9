"""The comparison runner's bookkeeping with training and evaluation faked (fast): statuses,
time budget, reports after every arm."""

import json
import os
import signal
import time
import types

import pytest

from train import loop
from train.experiments import budget, compare, presets


def _fake_train(behaviour):
    """loop.train stand-in: writes metrics rows; per arm: 'ok', 'nan' or 'slow' (runs until SIGINT)."""

    def train(cfg, progress=False, hooks=None):
        os.makedirs(cfg.run_dir)
        stop = []
        old = signal.signal(signal.SIGINT, lambda *_: stop.append(1))
        try:
            with open(os.path.join(cfg.run_dir, "metrics.jsonl"), "w") as f:
                for step in range(1, cfg.steps + 1):
                    if behaviour[cfg.arm] == "nan" and step == 2:
                        raise loop.NonFiniteLoss("loss is nan at step 2")
                    row = {
                        "step": step,
                        "loss": 3.0 - 0.1 * step,
                        "tokens_per_s": 100.0 * step,
                        "L1/max_gain": 1.0 + step,
                        "L1/top1_share": 0.3,
                        "L1/top4_share": 0.6,
                    }
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    while behaviour[cfg.arm] == "slow" and not stop:
                        time.sleep(0.01)
                    if stop:
                        return loop.TrainResult(cfg.run_dir, step, row, "interrupted", step)
        finally:
            signal.signal(signal.SIGINT, old)
        return loop.TrainResult(cfg.run_dir, cfg.steps, row, "done", cfg.steps)

    return train


@pytest.fixture
def faked(monkeypatch):
    behaviour = {}
    monkeypatch.setattr(
        compare,
        "make_run_config",
        lambda args, preset, arm, steps, run_dir, log_every=None: types.SimpleNamespace(
            arm=arm, steps=steps, run_dir=run_dir, batch_size=2, seq_len=8
        ),
    )
    monkeypatch.setattr(loop, "train", _fake_train(behaviour))
    monkeypatch.setattr(
        compare.evaluate,
        "evaluate_run",
        lambda run_dir, preset, log=None, hooks=None, on_part=None: dict(
            val_ce=2.5, gains={1: dict(max_gain=3.0, top1_share=0.3, top4_share=0.6)}
        ),
    )
    monkeypatch.setattr(presets.jax, "default_backend", lambda: "cpu")
    return behaviour


def _results(out):
    return {
        a[:-5]: json.load(open(os.path.join(out, "results", a)))
        for a in os.listdir(os.path.join(out, "results"))
    }


def test_statuses_and_report(tmp_path, faked):
    faked.update(reference="ok", stale="nan", matched="ok")
    out = str(tmp_path / "out")
    assert (
        compare.main(
            [
                "--preset",
                "tiny",
                "--arms",
                "reference,stale,matched,cudnn_fp8",
                "--steps",
                "3",
                "--out",
                out,
                "--runs-dir",
                str(tmp_path / "runs"),
                "--no-progress",
            ]
        )
        == 0
    )
    res = _results(out)
    assert {a: r["status"] for a, r in res.items()} == dict(
        reference="done", stale="diverged", matched="done", cudnn_fp8="not run"
    )
    assert res["matched"]["steps"] == 3 and res["matched"]["train_ce"] == pytest.approx(2.7)
    assert res["matched"]["tokens_per_s"] == pytest.approx(250.0)  # median without the first row
    assert "nan at step 2" in res["stale"]["reason"] and res["stale"]["steps"] == 1
    text = open(os.path.join(out, "report.md")).read()
    assert "needs an NVIDIA GPU" in text and "| cudnn_fp8 | not run |" in text
    for png in ("loss.png", "max_gain.png", "top_share.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000
    # --report-only rebuilds the same report from what was written.
    os.remove(os.path.join(out, "report.md"))
    assert (
        compare.main(["--arms", "reference,stale,matched,cudnn_fp8", "--out", out, "--report-only"])
        == 0
    )
    assert open(os.path.join(out, "report.md")).read() == text
    # --skip-done re-runs only the arms that did not finish, with the recorded step count.
    faked.update(stale="ok")
    before = os.path.getmtime(os.path.join(out, "results", "reference.json"))
    assert (
        compare.main(
            [
                "--preset",
                "tiny",
                "--arms",
                "reference,stale,matched,cudnn_fp8",
                "--steps",
                "5",
                "--out",
                out,
                "--runs-dir",
                str(tmp_path / "runs"),
                "--no-progress",
                "--skip-done",
            ]
        )
        == 0
    )
    res = _results(out)
    assert res["stale"]["status"] == "done" and res["stale"]["steps"] == 3
    assert os.path.getmtime(os.path.join(out, "results", "reference.json")) == before


def test_stopped_evaluation_keeps_training_results_and_finished_parts(tmp_path, faked, monkeypatch):
    """A process stopped during the evaluation (time limit, Ctrl-C) leaves the arm's
    training summary, metrics and finished evaluation parts on disk, marked incomplete."""
    faked.update(matched="ok")

    def evaluate_run(run_dir, preset, log=None, hooks=None, on_part=None):
        on_part(dict(gains={1: dict(max_gain=3.0, top1_share=0.3, top4_share=0.6)}, errors={}))
        raise KeyboardInterrupt  # stopped during the next part

    monkeypatch.setattr(compare.evaluate, "evaluate_run", evaluate_run)
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        compare.main(
            [
                "--preset",
                "tiny",
                "--arms",
                "matched",
                "--steps",
                "3",
                "--out",
                out,
                "--runs-dir",
                str(tmp_path / "runs"),
                "--no-progress",
            ]
        )
    res = _results(out)["matched"]
    assert res["status"] == compare.EVALUATION_INCOMPLETE and "did not finish" in res["reason"]
    assert res["train_ce"] == pytest.approx(2.7) and res["gains"]["1"]["max_gain"] == 3.0
    assert os.path.exists(os.path.join(out, "metrics", "matched", "metrics.jsonl"))
    assert not [f for f in os.listdir(os.path.join(out, "results")) if f.endswith(".tmp")]
    # the report is rebuilt from what was kept, and --skip-done trains the arm again
    assert compare.main(["--arms", "matched", "--out", out, "--report-only"]) == 0
    assert (
        "| matched | trained, evaluation incomplete |"
        in open(os.path.join(out, "report.md")).read()
    )


def test_time_budget_sets_common_steps_and_stops_slow_arms(tmp_path, faked, monkeypatch):
    faked.update(matched="ok", stale="slow")
    monkeypatch.setattr(
        budget,
        "calibrate",
        lambda make, scratch, steps, hooks: budget.Calibration(
            0.01 if make(steps, scratch, 1).arm == "matched" else 0.005, 1.0
        ),
    )  # matched is the slower arm
    out = str(tmp_path / "out")
    # 0.05 min = 3 s: the default 60 s evaluation reserve would leave nothing, so keep 1.2 s.
    argv = [
        "--preset",
        "tiny",
        "--arms",
        "matched,stale",
        "--minutes-per-arm",
        "0.05",
        "--eval-minutes",
        "0.02",
        "--out",
        out,
        "--runs-dir",
        str(tmp_path / "runs"),
        "--no-progress",
    ]
    assert compare.main(argv) == 0
    res = _results(out)
    steps = json.load(open(os.path.join(out, "setup.json")))["steps"]
    # 3 s - 1.2 s reserve - 1 s set-up - (short) calibration, at 0.01 s/step, 85% margin.
    assert 50 <= steps <= budget.steps_for_budget(budget.Calibration(0.01, 1.0), 3, reserve_s=1.2)
    assert res["matched"]["status"] == "done" and res["matched"]["steps"] == steps
    assert res["stale"]["status"] == "stopped by time budget" and res["stale"]["steps"] == 1
    assert "Budget: 0.1 min per arm" in open(os.path.join(out, "report.md")).read()
