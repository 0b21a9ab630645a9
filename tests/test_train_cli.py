"""`python -m train` and `python -m train.plot` end to end with the real hybrid model."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dm_jax.nn import fp8
from train import config as config_lib
from train import model as model_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=400):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_cli_trains_the_default_hybrid_plots_and_resumes_bit_exact(tmp_path):
    """One cold `python -m train` run (its compiled programs land in the suite's compilation
    cache) serves both checks: what a run writes and plots, and that a run stopped at step 2
    and resumed from its checkpoint repeats it bit for bit."""
    run_dir = tmp_path / "run"
    common = ["--steps", "4", "--batch-size", "2", "--seq-len", "64", "--log-every", "1"]
    common += ["--optimizer", "muon", "--ckpt-every", "2"]
    proc = _run(
        "train",
        *common,
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--probe-every",
        "2",
        "--run-dir",
        str(run_dir),
    )
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
    assert sorted(os.listdir(tmp_path / "plots")) == [
        "loss.png",
        "max_gain.png",
        "residual.png",
        "top_share.png",
    ]

    # The same run stopped at step 2 and resumed repeats it bit for bit; without validation
    # or probes, which must not change what the run trains either.
    common += ["--eval-every", "0", "--probe-every", "0"]
    half_dir = tmp_path / "b"
    half = _run("train", *common, "--stop-at", "2", "--run-dir", str(half_dir))
    assert half.returncode == 0, half.stderr[-3000:]
    refused = _run("train", *common, "--run-dir", str(half_dir))  # no --resume: refused
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = _run("train", "--resume", "--run-dir", str(half_dir))  # the saved flags
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = lambda d: [
        (r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(d / "metrics.jsonl"))
    ]  # noqa: E731
    assert rows(run_dir) == rows(half_dir) and len(rows(run_dir)) == 4
    # The checkpoint holds the model's parameters under their names: orbax alone reads it.
    import orbax.checkpoint as ocp
    from flax import nnx

    from train import loop

    named = ocp.StandardCheckpointer().restore(str(half_dir / "checkpoints" / "4" / "params"))
    model, _ = loop.load_model(str(half_dir))
    np.testing.assert_array_equal(
        named["layers"]["3"]["mixer"]["q_norm"]["scale"],
        np.asarray(model.layers[3].mixer.q_norm.scale.get_value()),
    )
    np.testing.assert_array_equal(
        named["embed"]["embedding"], np.asarray(model.embed.embedding.get_value())
    )
    assert len(jax.tree.leaves(named)) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--steps", "0"], "--steps"),
        (["--preset", "huge"], "--preset"),
        (["--preset", "nofamily-tiny"], "--preset"),
        (["--attention", "fp4"], "--attention"),
        (["--data", "/no/such/path"], "--data"),
        (["--fresh-optimizer"], "--fresh-optimizer"),
        (["--resume", "--init-from", "x"], "--init-from"),
        (["--tokenizer", "tiktoken"], "--tiktoken"),
        # Zero and negative values are errors, never "use the default".
        (["--batch-size", "0"], "--batch-size"),
        (["--seq-len", "0"], "--seq-len"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--stop-at", "-3"], "--stop-at"),
        (["--stop-at", "0"], "--stop-at"),
        (["--eval-batches", "0"], "--eval-batches"),
        (["--seed", "-1"], "--seed"),
        (["--head-dim", "0"], "--head-dim"),
        (["--state-scan-unroll", "0"], "--state-scan-unroll"),
        (["--adam-lr-ratio", "0"], "--adam-lr-ratio"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
        (["--warmup", "-1"], "--warmup"),
        (["--resume"], "--resume"),
        (["--resume", "--run-dir", "/no/such/run"], "--resume"),
    ],
)
def test_bad_flags_fail_before_compute_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        config_lib.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err
    if flag not in ("--attention",):  # a value argparse itself rejects comes with the usage
        assert err.count("\n") == 1 and err.startswith("python -m train: error: "), err


def test_tiktoken_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as on an install without .[bpe]
    with pytest.raises(SystemExit) as e:
        config_lib.parse_args(["--tiktoken", "gpt2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--tiktoken" in err and "pip install -e '.[bpe]'" in err
    assert "Traceback" not in err


def test_help_lists_presets_and_their_defaults(capsys):
    from dm_jax import models

    with pytest.raises(SystemExit):
        config_lib.parse_args(["--help"])
    out = capsys.readouterr().out
    for name in models.FAMILIES + models.SIZES:
        assert name in out, name
    for size, d in config_lib.SIZE_DEFAULTS.items():  # one row of defaults per size
        row = next(line.split() for line in out.splitlines() if line.split()[:1] == [size])
        assert row[1:5] == [
            str(d["batch_size"]),
            str(d["seq_len"]),
            str(d["steps"]),
            f"{d['learning_rate']:g}",
        ]


def test_resume_takes_the_saved_config(tmp_path):
    saved = config_lib.parse_args(
        [
            "--preset",
            "gdn_mla-tiny",
            "--lr",
            "1e-3",
            "--seq-len",
            "64",
            "--optimizer",
            "muon",
            "--run-dir",
            str(tmp_path),
        ]
    )
    saved.save(str(tmp_path))
    resumed = config_lib.parse_args(["--resume", "--run-dir", str(tmp_path)])
    assert resumed.compat_dict() == saved.compat_dict() and resumed.resume
    more = config_lib.parse_args(
        ["--resume", "--run-dir", str(tmp_path), "--steps", "900", "--log-every", "5"]
    )
    assert (more.steps, more.log_every, more.seq_len, more.optimizer.name) == (900, 5, 64, "muon")
    assert (
        more.optimizer.warmup_steps == saved.optimizer.warmup_steps
    )  # not re-derived from --steps
    clash = config_lib.parse_args(["--resume", "--run-dir", str(tmp_path), "--attention", "stale"])
    with pytest.raises(
        ValueError, match=r"model.overrides.attention: 'matched' -> 'stale' \(--attention\)"
    ):
        config_lib.check_compatible(saved, clash)
    # how the mixers carry state across chunks changes compilation, not the math
    other_pass = ["--state-pass", "associative", "--state-scan-unroll", "2"]
    switched = config_lib.parse_args(["--resume", "--run-dir", str(tmp_path)] + other_pass)
    overrides = dict(switched.model.overrides)
    assert (overrides["state_pass"], overrides["state_scan_unroll"]) == ("associative", 2)
    config_lib.check_compatible(saved, switched)
    stopped = dataclasses.replace(saved, stop_at=3)  # --stop-at belongs to one invocation
    stopped.save(str(tmp_path))
    assert config_lib.parse_args(["--resume", "--run-dir", str(tmp_path)]).stop_at is None


def test_every_flag_maps_to_config_fields():
    dests = {a.dest for a in config_lib.build_parser()._actions if a.dest != "help"}
    assert dests == set(config_lib.FLAG_FIELDS)
    fields = set(config_lib._flatten(config_lib._tree(config_lib.parse_args(["--run-dir", "x"]))))
    for dest, paths in config_lib.FLAG_FIELDS.items():
        assert set(paths) <= fields | {p for p in paths if p.startswith("model.overrides.")}, dest


def test_one_line_errors_for_the_run_dir(tmp_path, capsys):
    from train.__main__ import main

    (tmp_path / "file").write_text("x")
    assert main(["--run-dir", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --run-dir") and "is a file" in err


def test_presets_and_arms_resolve():
    cfg = config_lib.parse_args(
        ["--preset", "gdn_mla-small", "--attention", "stale", "--seq-len", "256"]
    )
    assert cfg.model.family == "gdn_mla" and cfg.model.size == "small" and cfg.seq_len == 256
    assert cfg.model_config.attention == "stale" and "mla" in cfg.model_config.pattern
    assert cfg.model_config.vocab_size % 64 == 0 and cfg.model_config.vocab_size >= 257
    tiny = config_lib.parse_args(["--run-dir", "x"])
    assert tiny.model.name == "gdn_gqa-tiny" and tiny.attention == "matched"
    assert tiny.model_config.fp8_scaling == "per_token"
    per_tensor = config_lib.parse_args(["--run-dir", "x", "--fp8-scaling", "per_tensor"])
    assert per_tensor.model_config.fp8_scaling == "per_tensor"
    assert tiny.model_config.ffn == "fp8"
    bf16_ffn = config_lib.parse_args(["--run-dir", "x", "--ffn", "bf16"])
    assert bf16_ffn.model_config.ffn == "bf16"
    x = jnp.ones((1, 8), jnp.int32)
    fp8_dots = {
        name: fp8.fp8_dot_count(jax.make_jaxpr(lambda x, m=model_lib.build_hybrid(cfg): m(x))(x))
        for name, cfg in (("fp8", tiny), ("bf16", bf16_ffn))
    }
    assert fp8_dots["bf16"] < fp8_dots["fp8"]  # the FFN's dots left FP8, attention's did not
    with pytest.raises(ValueError, match="--ffn"):  # other math: a new run, not a resume
        config_lib.check_compatible(tiny, bf16_ffn)
    # Arms differ only in the attention override: same seed, data and everything else.
    a, b = tiny, config_lib.parse_args(["--run-dir", "x", "--attention", "reference"])
    diff = {k for k in a.compat_dict() if a.compat_dict()[k] != b.compat_dict()[k]}
    assert diff == {"model"} and a.seed == b.seed


_LONG_STEP = """
import sys, time
sys.path.insert(0, {tests!r})
import jax, numpy as np
from test_train_standin import HOOKS, tiny_config
from train import loop

make = loop.make_step_fns


def make_with_a_long_step(*args, **kwargs):
    step, evaluate = make(*args, **kwargs)
    calls = [0]

    def sleep_in_xla(x):  # a device call that keeps the main thread inside XLA
        open({marker!r}, "w").close()
        time.sleep(600)
        return x

    slow = jax.jit(lambda x: jax.pure_callback(sleep_in_xla, jax.ShapeDtypeStruct((), np.int32), x))

    def stepper(*a):
        calls[0] += 1
        out = step(*a)
        if calls[0] == 5:
            jax.block_until_ready(slow(np.int32(0)))
        return out

    return stepper, evaluate


loop.make_step_fns = make_with_a_long_step
cfg = tiny_config({run_dir!r}, steps=6, ckpt_every=2, eval_every=0, probe_every=0, log_every=1)
loop.train(cfg, progress=False, hooks=HOOKS)
"""


def test_second_signal_stops_a_long_step_at_once(tmp_path):
    """The main thread is stuck in XLA (a 10-minute step): the first SIGTERM is acknowledged at
    once, the second ends the process at once, naming the checkpoint the run resumes from."""
    marker, run_dir = tmp_path / "in_long_step", tmp_path / "run"
    script = _LONG_STEP.format(
        tests=os.path.join(ROOT, "tests"), marker=str(marker), run_dir=str(run_dir)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 300
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), (
            proc.stderr.read()[-3000:] if proc.poll() is not None else "no long step"
        )
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        assert proc.poll() is None  # the first signal waits for the step to end...
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)  # ...the second does not
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert (
        "SIGTERM: stopping after the current step" in err and "SIGTERM again: stopping now" in err
    )
    assert (
        f"resumes from its checkpoint at step 4: python -m train --resume --run-dir {run_dir}"
        in err
    )
    assert "Traceback" not in err
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]


def test_fused_projections_flag_reaches_the_mixers_and_may_change_on_resume(tmp_path):
    argv = ["--preset", "tiny", "--run-dir", str(tmp_path), "--fused-projections", "off"]
    cfg = config_lib.parse_args(argv)
    model = cfg.model.build()
    assert model.fused_projections is False
    assert config_lib.parse_args(["--preset", "tiny"]).model.build().fused_projections is True
    cfg.save(str(tmp_path))
    on = config_lib.parse_args(
        ["--resume", "--run-dir", str(tmp_path), "--fused-projections", "on"]
    )
    assert on.model.build().fused_projections is True
    config_lib.check_compatible(cfg, on)  # how the step is computed, not the parameters


def test_cudnn_documents_flag_reaches_the_model_and_may_change_on_resume(tmp_path):
    cfg = config_lib.parse_args(
        ["--preset", "tiny", "--attention", "cudnn_bf16", "--run-dir", str(tmp_path)]
    )
    assert cfg.model.build().cudnn_documents == "packed"  # the default
    cfg.save(str(tmp_path))
    argv = ["--resume", "--run-dir", str(tmp_path), "--cudnn-documents", "mask"]
    masked = config_lib.parse_args(argv)
    assert masked.model.build().cudnn_documents == "mask"
    config_lib.check_compatible(cfg, masked)  # how cuDNN reads documents, not the model
    with pytest.raises(SystemExit):
        config_lib.parse_args(["--cudnn-documents", "dense"])
