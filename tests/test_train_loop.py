"""Training loop: metrics, bit-exact resume, NaN stop, signals, refusal of foreign run dirs."""

import dataclasses
import json
import os
import shutil
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
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "L0/max_gain",
        "L1/top1_share",
        "L1/top4_share",
    ):
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
    resumed = loop.train(
        tiny_config(tmp_path / "b", resume=True, **kw), progress=False, hooks=HOOKS
    )
    assert resumed.step == straight.step == 6
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    for x, y in zip(_params(str(tmp_path / "a")), _params(str(tmp_path / "b"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    opt = config_lib.OptimizerConfig(learning_rate=1e36, warmup_steps=0, clip_norm=1e30)
    cfg = tiny_config(
        tmp_path / "run", steps=8, ckpt_every=1, eval_every=0, probe_every=0, optimizer=opt
    )
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
        loop.train(
            dataclasses.replace(cfg, run_dir=str(tmp_path / "junk")), progress=False, hooks=HOOKS
        )


def test_init_from_with_fresh_optimizer(tmp_path):
    kw = dict(ckpt_every=0, eval_every=0, probe_every=0)
    loop.train(tiny_config(tmp_path / "base", steps=2, **kw), progress=False, hooks=HOOKS)
    cfg = tiny_config(
        tmp_path / "ext",
        steps=1,
        seq_len=64,
        init_from=str(tmp_path / "base"),
        fresh_optimizer=True,
        log_every=1,
        **kw,
    )
    result = loop.train(cfg, progress=False, hooks=HOOKS)
    assert result.step == 1
    base = _params(str(tmp_path / "base"))
    ext = _params(str(tmp_path / "ext"))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(base, ext))
    first = _losses(tmp_path / "ext")[1]
    scratch = loop.train(
        tiny_config(tmp_path / "scratch", steps=1, seq_len=64, log_every=1, **kw),
        progress=False,
        hooks=HOOKS,
    )
    assert first < scratch.metrics["loss"]  # starts from the trained weights


def _tree_digest(path):
    """{relative path: bytes} of every file under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def _damage(step_dir, how):
    if how == "truncated array file":
        files = [
            os.path.join(r, n)
            for r, _, ns in os.walk(os.path.join(step_dir, "params"))
            for n in ns
            if os.sep + "d" + os.sep in os.path.join(r, n)
            and os.path.getsize(os.path.join(r, n)) > 64
        ]
        target = max(files, key=os.path.getsize)
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    elif how == "garbage metadata":
        with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
            f.write("\x00not json")
    else:  # a missing item
        shutil.rmtree(os.path.join(step_dir, "params"))


@pytest.mark.parametrize("how", ["truncated array file", "garbage metadata", "missing params item"])
def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, capsys, how):
    kw = dict(steps=6, ckpt_every=3, eval_every=0, probe_every=0, log_every=1)
    loop.train(tiny_config(tmp_path / "a", **kw), progress=False, hooks=HOOKS)
    # A run that stopped at 5 with checkpoints 3 and 5, the newest of them damaged on disk.
    loop.train(tiny_config(tmp_path / "b", stop_at=5, **kw), progress=False, hooks=HOOKS)
    ckpts = tmp_path / "b" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["3", "5"]
    _damage(str(ckpts / "5"), how)
    damaged = _tree_digest(ckpts / "5")
    capsys.readouterr()

    resumed = loop.train(
        tiny_config(tmp_path / "b", resume=True, **kw), progress=False, hooks=HOOKS
    )
    err = capsys.readouterr().err
    assert resumed.status == "done" and resumed.step == 6
    assert str(ckpts / "5") in err and "resuming from the checkpoint at step 3" in err
    # Same result as if checkpoint 5 had never been written, and its files kept byte for byte.
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    for x, y in zip(_params(str(tmp_path / "a")), _params(str(tmp_path / "b"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert _tree_digest(tmp_path / "b" / "damaged_checkpoints" / "5") == damaged
    assert "5" not in os.listdir(ckpts) or sorted(os.listdir(ckpts)) == ["3", "6"]


def test_every_checkpoint_damaged_is_one_error_naming_them(tmp_path):
    kw = dict(steps=3, ckpt_every=0, eval_every=0, probe_every=0)
    loop.train(tiny_config(tmp_path / "b", **kw), progress=False, hooks=HOOKS)
    _damage(str(tmp_path / "b" / "checkpoints" / "3"), "garbage metadata")
    with pytest.raises(
        ValueError, match=r"no readable checkpoint.*checkpoints/3: cannot read meta"
    ):
        loop.train(tiny_config(tmp_path / "b", resume=True, **kw), progress=False, hooks=HOOKS)
    assert os.listdir(tmp_path / "b" / "checkpoints") == ["3"]  # left where it was


def test_extending_a_run_continues_the_schedule(tmp_path):
    kw = dict(ckpt_every=0, eval_every=0, probe_every=0, log_every=1)
    loop.train(tiny_config(tmp_path / "a", steps=6, **kw), progress=False, hooks=HOOKS)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    lr = lambda d: {r["step"]: r["lr"] for r in map(json.loads, open(d / "metrics.jsonl"))}  # noqa: E731
    done = lr(tmp_path / "a")
    # Extend 6 -> 10 in one go (a), or with a stop at 8 and a second resume (b): bit-exact.
    loop.train(
        tiny_config(tmp_path / "a", steps=10, resume=True, **kw), progress=False, hooks=HOOKS
    )
    loop.train(
        tiny_config(tmp_path / "b", steps=10, stop_at=8, resume=True, **kw),
        progress=False,
        hooks=HOOKS,
    )
    loop.train(
        tiny_config(tmp_path / "b", steps=10, resume=True, **kw), progress=False, hooks=HOOKS
    )
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b") and len(_losses(tmp_path / "a")) == 10
    rates = lr(tmp_path / "a")
    assert all(rates[s] == done[s] for s in range(1, 7))  # the steps taken keep their rates
    assert (
        rates[7] <= rates[6] and rates[6] - rates[7] < rates[5] - rates[6] + 1e-9
    )  # no jump back up
    assert rates[10] == pytest.approx(3e-3 * 0.1, rel=1e-3)  # the floor at the new end
    assert config_lib.RunConfig.load(str(tmp_path / "b")).extensions == ((6, 6),)
    with pytest.raises(ValueError, match="--steps 5: the run is already at step 10"):
        loop.train(
            tiny_config(tmp_path / "a", steps=5, resume=True, **kw), progress=False, hooks=HOOKS
        )


def test_tensorboard_has_each_step_once_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kw = dict(steps=6, ckpt_every=2, eval_every=0, probe_every=0, log_every=1)
    loop.train(tiny_config(tmp_path / "b", stop_at=3, **kw), progress=False, hooks=HOOKS)
    # As if the run had died after logging step 3 but before checkpointing it: resume from 2.
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "3")
    loop.train(tiny_config(tmp_path / "b", resume=True, **kw), progress=False, hooks=HOOKS)
    acc = EventAccumulator(str(tmp_path / "b" / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    steps = [e.step for e in acc.Tensors("loss")]
    assert steps == [1, 2, 3, 4, 5, 6]
    losses = [float(np.asarray(acc.Tensors("loss")[i].tensor_proto.float_val[0])) for i in range(6)]
    assert losses == pytest.approx([_losses(tmp_path / "b")[s] for s in range(1, 7)], rel=1e-6)


def test_failed_new_run_leaves_no_directory(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path / "run", steps=2, ckpt_every=0, eval_every=0, probe_every=0)
    monkeypatch.setattr(
        loop, "make_step_fns", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        loop.train(cfg, progress=False, hooks=HOOKS)
    assert not os.path.exists(tmp_path / "run")
    # Checks that fail before any work create nothing either.
    (tmp_path / "x.txt").write_text("too short")
    tiny = dataclasses.replace(cfg, data=config_lib.DataConfig(source=str(tmp_path / "x.txt")))
    with pytest.raises(ValueError, match="train split has"):
        loop.train(tiny, progress=False, hooks=HOOKS)
    assert not os.path.exists(tmp_path / "run")


def test_run_dir_errors_name_the_flag(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    for run_dir in (tmp_path / "file", tmp_path / "file" / "sub"):
        cfg = tiny_config(run_dir, steps=1, ckpt_every=0, eval_every=0, probe_every=0)
        with pytest.raises(ValueError, match="--run-dir .* is a file, expected a directory"):
            loop.train(cfg, progress=False, hooks=HOOKS)

    def denied(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(config_lib, "write_json_atomic", denied)
    cfg = tiny_config(tmp_path / "ro", steps=1, ckpt_every=0, eval_every=0, probe_every=0)
    with pytest.raises(
        ValueError, match="--run-dir .*: cannot write config.json \\(Permission denied\\)"
    ):
        loop.train(cfg, progress=False, hooks=HOOKS)
    assert not os.path.exists(tmp_path / "ro")
