"""Training loop: metrics, bit-exact resume, NaN stop, signals, refusal of foreign run dirs."""

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest

from test_train_standin import HOOKS, tiny_config
from train import config as config_lib
from train import data as data_lib
from train import loop


def _params(run_dir, step=None):
    model, _ = loop.load_model(run_dir, hooks=HOOKS, step=step)
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))


def _losses(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows}


def test_metrics_rows_and_outputs(tmp_path):
    cfg = tiny_config(tmp_path / "run", steps=4, eval_every=4, probe_every=4, log_every=1)
    result = loop.train(cfg, progress=False, hooks=HOOKS)
    assert result.status == "done" and result.step == 4 and result.checkpoint_step == 4
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "L0/max_gain", "L1/top1_share", "L1/top4_share"):
        assert all(np.isfinite(r[key]) for r in rows), key
    last = rows[-1]
    assert 0 < last["val_ce"] < 10 and last["L0/top1_share"] <= last["L0/top4_share"] <= 1
    # Delta-Matching: dS rows sum to zero (up to FP32 rounding) before the FP8 cast.
    assert last["L0/residual_pre"] < 1e-4 and last["L1/residual_pre"] < 1e-4
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    assert os.listdir(tmp_path / "run" / "tensorboard")
    assert config_lib.RunConfig.load(str(tmp_path / "run")) == cfg


def test_resume_is_bit_exact(tmp_path):
    kw = dict(steps=6, ckpt_every=2, eval_every=0, probe_every=0, log_every=1)
    straight = loop.train(tiny_config(tmp_path / "a", **kw), progress=False, hooks=HOOKS)
    half = loop.train(tiny_config(tmp_path / "b", stop_at=3, **kw), progress=False, hooks=HOOKS)
    assert half.status == "stopped" and half.step == 3 and half.checkpoint_step == 3
    resumed = loop.train(tiny_config(tmp_path / "b", resume=True, **kw), progress=False, hooks=HOOKS)
    assert resumed.step == straight.step == 6
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    for x, y in zip(_params(str(tmp_path / "a")), _params(str(tmp_path / "b"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    opt = config_lib.OptimizerConfig(learning_rate=1e36, warmup_steps=0, clip_norm=1e30)
    cfg = tiny_config(tmp_path / "run", steps=8, ckpt_every=1, eval_every=0, probe_every=0, optimizer=opt)
    with pytest.raises(loop.NonFiniteLoss, match="loss is"):
        loop.train(cfg, progress=False, hooks=HOOKS)
    params = _params(str(tmp_path / "run"))
    assert all(np.isfinite(np.asarray(p)).all() for p in params)
    steps = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit())
    assert steps and steps[-1] < 8


def test_sigterm_writes_checkpoint_and_exits(tmp_path, monkeypatch):
    original = data_lib.Batches.batch

    def batch_then_signal(self, index, **kw):
        if self.shuffle and index == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, index, **kw)

    monkeypatch.setattr(data_lib.Batches, "batch", batch_then_signal)
    cfg = tiny_config(tmp_path / "run", steps=6, ckpt_every=0, eval_every=0, probe_every=0)
    result = loop.train(cfg, progress=False, hooks=HOOKS)
    assert result.status == "interrupted" and result.step == 3 and result.checkpoint_step == 3
    assert signal.getsignal(signal.SIGTERM) is not None  # handler restored


def test_run_dir_refusals(tmp_path):
    cfg = tiny_config(tmp_path / "run", steps=2, ckpt_every=0, eval_every=0, probe_every=0)
    loop.train(cfg, progress=False, hooks=HOOKS)
    with pytest.raises(ValueError, match="--resume"):  # same config, but no --resume
        loop.train(cfg, progress=False, hooks=HOOKS)
    other = dataclasses.replace(cfg, seq_len=16, resume=True)
    with pytest.raises(ValueError, match="seq_len"):  # incompatible config
        loop.train(other, progress=False, hooks=HOOKS)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="not a run directory"):
        loop.train(dataclasses.replace(cfg, run_dir=str(tmp_path / "junk")), progress=False, hooks=HOOKS)


def test_init_from_with_fresh_optimizer(tmp_path):
    kw = dict(ckpt_every=0, eval_every=0, probe_every=0)
    loop.train(tiny_config(tmp_path / "base", steps=2, **kw), progress=False, hooks=HOOKS)
    cfg = tiny_config(tmp_path / "ext", steps=1, seq_len=64, init_from=str(tmp_path / "base"),
                      fresh_optimizer=True, log_every=1, **kw)
    result = loop.train(cfg, progress=False, hooks=HOOKS)
    assert result.step == 1
    base = _params(str(tmp_path / "base"))
    ext = _params(str(tmp_path / "ext"))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(base, ext))
    first = _losses(tmp_path / "ext")[1]
    scratch = loop.train(tiny_config(tmp_path / "scratch", steps=1, seq_len=64, log_every=1, **kw),
                         progress=False, hooks=HOOKS)
    assert first < scratch.metrics["loss"]  # starts from the trained weights
