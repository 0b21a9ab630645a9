"""`python -m train` and `python -m train.plot` end to end with the real hybrid model."""

import json
import os
import subprocess
import sys

import pytest

from train import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_trains_the_default_hybrid_and_plots(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run("train", "--steps", "4", "--batch-size", "2", "--seq-len", "64", "--log-every", "1",
                "--eval-every", "4", "--eval-batches", "1", "--probe-every", "2", "--optimizer", "muon",
                "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(run_dir) in proc.stdout and "tokens/s" in proc.stdout
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "val_ce" in rows[-1] and "L3/max_gain" in rows[-1] and "L3/residual_post" in rows[1]
    assert rows[-1]["loss"] < rows[0]["loss"]
    saved = json.load(open(run_dir / "config.json"))
    assert saved["model_config"]["pattern"] == ["gdn", "gdn", "gdn", "attn"]
    assert saved["run_config"]["optimizer"]["name"] == "muon"

    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(open(run_dir / "metrics.jsonl").read())
    plot = _run("train.plot", str(run_dir), str(other), "--out", str(tmp_path / "plots"))
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "plots")) == ["loss.png", "max_gain.png", "residual.png",
                                                      "top_share.png"]


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"),
    (["--preset", "huge"], "--preset"),
    (["--preset", "nofamily-tiny"], "--preset"),
    (["--attention", "fp4"], "--attention"),
    (["--data", "/no/such/path"], "--data"),
    (["--fresh-optimizer"], "--fresh-optimizer"),
    (["--resume", "--init-from", "x"], "--init-from"),
    (["--tokenizer", "tiktoken"], "--tiktoken"),
])
def test_bad_flags_fail_before_compute_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        config_lib.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_presets_and_arms_resolve():
    cfg = config_lib.parse_args(["--preset", "gdn_mla-small", "--attention", "stale", "--seq-len", "256"])
    assert cfg.model.family == "gdn_mla" and cfg.model.size == "small" and cfg.seq_len == 256
    assert cfg.model_config.attention == "stale" and "mla" in cfg.model_config.pattern
    assert cfg.model_config.vocab_size % 64 == 0 and cfg.model_config.vocab_size >= 257
    tiny = config_lib.parse_args(["--run-dir", "x"])
    assert tiny.model.name == "gdn_gqa-tiny" and tiny.attention == "matched"
    # Arms differ only in the attention override: same seed, data and everything else.
    a, b = tiny, config_lib.parse_args(["--run-dir", "x", "--attention", "reference"])
    diff = {k for k in a.compat_dict() if a.compat_dict()[k] != b.compat_dict()[k]}
    assert diff == {"model"} and a.seed == b.seed


def test_cli_resume_is_bit_exact_with_the_hybrid(tmp_path):
    common = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--eval-every", "0",
              "--probe-every", "0", "--ckpt-every", "2"]
    straight = _run("train", *common, "--run-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    half = _run("train", *common, "--stop-at", "2", "--run-dir", str(tmp_path / "b"))
    assert half.returncode == 0, half.stderr[-3000:]
    refused = _run("train", *common, "--run-dir", str(tmp_path / "b"))  # no --resume: refused
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = _run("train", *common, "--resume", "--run-dir", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = lambda d: [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(d / "metrics.jsonl"))]  # noqa: E731
    assert rows(tmp_path / "a") == rows(tmp_path / "b") and len(rows(tmp_path / "a")) == 4
