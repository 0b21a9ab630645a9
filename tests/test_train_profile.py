"""`python -m train.profile_step`: a profiled step summarised by layer kind and op class."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from train import profile_step, trace_summary


def test_classify_reads_named_scopes():
    c = trace_summary.classify
    assert c("jit(train_step)/while/body/gdn/mixer/dot_general") == ("gdn", "mixer", "forward")
    assert c("jit(train_step)/transpose(jvp(attn))/mixer/attention_core/custom_vjp_call") == (
        "attn",
        "attention_core",
        "backward",
    )
    assert c("jit(train_step)/jvp(mla)/ffn/dot_general")[:2] == ("mla", "ffn")
    assert c("jit(train_step)/optimizer/mul") == ("optimizer", "optimizer", "update")
    assert c("jit(train_step)/add") == ("other", "other", "forward")
    assert c("jit(train_step)/jvp()/while/body/closed_call")[:2] == ("scan", "scan")


def test_summary_of_a_profiled_function(tmp_path):
    def f(x, w):
        with jax.named_scope("gdn"), jax.named_scope("mixer"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("ffn"):
            return (y @ w).sum()

    step = jax.jit(jax.grad(f))
    x = jnp.ones((256, 256))
    compiled = step.lower(x, x).compile()
    compiled(x, x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(2):
            compiled(x, x).block_until_ready()
    ops = trace_summary.op_events(trace_summary.read_trace(str(tmp_path)), "jit_f")
    assert ops, "the trace holds no operation of the function"
    summary = trace_summary.summarize(ops, trace_summary.op_names(compiled.as_text()), 1.0, 2)
    shares = summary["by_op_class"]
    assert shares["mixer"][0] > 0 and shares["ffn"][0] > 0
    assert sum(share for _, share in shares.values()) == pytest.approx(1.0)
    assert summary["by_direction"]["backward"][0] > 0
    assert any("ffn" in name for name in summary["top_op_names"])
    md = trace_summary.markdown(summary, "toy")
    assert "| mixer |" in md and "| host |" in md


def test_profile_step_writes_json_and_markdown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # main() turns CUDA command buffers off in it
    out = tmp_path / "prof"
    argv = ["--preset", "gqa-tiny", "--batch-size", "2", "--seq-len", "64", "--scan-layers", "on"]
    argv += ["--out", str(out)]
    assert profile_step.main(argv + ["--warmup", "1", "--profile-steps", "2"]) == 0
    payload = json.loads((out / "profile.json").read_text())
    kinds, classes = payload["by_layer_kind"], payload["by_op_class"]
    assert kinds["attn"][0] > 0 and kinds["optimizer"][0] > 0
    assert classes["attention_core"][0] > 0 and classes["ffn"][0] > 0 and classes["norm"][0] > 0
    assert sum(share for _, share in classes.values()) == pytest.approx(1.0)
    assert classes.get("other", [0, 0])[1] < 0.3  # nearly every operation has its scope
    assert payload["scan_layers"] and payload["tokens_per_s"] > 0 and payload["mfu"] is None
    assert payload["compile_seconds"] > 0
    # command buffers off; cuBLAS matmuls too if jax had not started in this process yet
    assert payload["xla_flags"] in (
        "--xla_gpu_enable_command_buffer=",
        "--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false",
    )
    md = (out / "profile.md").read_text()
    assert "| attention_core |" in md and "the bound on any attention speed-up" in md
    assert "tokens/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_step.main(["--preset", "gqa-tiny"])  # --out is required


def test_op_events_read_a_gpu_style_timeline_and_skip_enclosing_loops():
    def event(name, ts, dur, thread, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=thread, thread=thread, args=args)

    events = [
        event("while.3", 0.0, 10.0, "XLA Ops"),  # spans its body's operations
        event("fusion.1", 1.0, 4.0, "XLA Ops"),
        event("fusion.2", 5.0, 3.0, "XLA Ops"),
        event("kernel_xyz", 1.0, 4.0, "Stream #7", hlo_op="fusion.1", hlo_module="jit_train_step"),
        event("other.9", 20.0, 2.0, "XLA Ops", hlo_op="other.9", hlo_module="jit_eval_step"),
    ]
    ops = trace_summary.op_events(events, "train_step")
    assert sorted(e["args"]["hlo_op"] for e in ops) == ["fusion.1", "fusion.2"]
    names = {"fusion.1": "jit(train_step)/jvp(gdn)/mixer/dot", "fusion.2": "x/optimizer/add"}
    summary = trace_summary.summarize(ops, names, wall_s=10e-6, steps=1)
    assert summary["by_op_class"]["mixer"][0] == pytest.approx(4e-6)
    assert summary["by_op_class"]["optimizer"][0] == pytest.approx(3e-6)
    assert summary["host_s"] == pytest.approx(3e-6)


def test_command_buffers_off_keeps_other_xla_flags(monkeypatch):
    """On a GPU the trace names a command buffer, not its kernels: --command-buffers off
    (the default) adds the flag that turns them off, keeping the user's other flags and
    leaving a command-buffer setting of the user's alone."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    profile_step._disable_command_buffers()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    profile_step._disable_command_buffers()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"


def test_kernels_missing_from_the_xla_ops_line_count_and_busy_time_is_not_host_time():
    """An operation seen only on a stream (not on 'XLA Ops') counts with its kernel time;
    kernel time no named operation explains is 'unattributed', not host time."""

    def event(name, ts, dur, thread, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=thread, thread=thread, args=args)

    module = dict(hlo_module="jit_train_step")
    events = [
        event("fusion.1", 0.0, 4.0, "XLA Ops"),
        event("k1", 0.5, 3.0, "Stream #7", hlo_op="fusion.1", **module),
        event("gemm", 5.0, 6.0, "Stream #7", hlo_op="custom-call.2", **module),  # no XLA Ops event
        event("anon", 12.0, 5.0, "Stream #9", **module),  # a kernel without an operation name
        event("python", 0.0, 20.0, "main"),
    ]
    ops = trace_summary.op_events(events, "train_step")
    assert sorted(e["args"]["hlo_op"] for e in ops) == ["custom-call.2", "fusion.1"]
    assert trace_summary.stream_busy(events, "train_step") == pytest.approx(14e-6)
    assert trace_summary.stream_busy([events[-1]], "train_step") is None  # no GPU timeline
    names = {"fusion.1": "jit(train_step)/jvp(gdn)/mixer/x", "custom-call.2": "a/gdn/ffn/dot"}
    busy = trace_summary.stream_busy(events, "train_step")
    summary = trace_summary.summarize(ops, names, wall_s=20e-6, steps=1, busy_s=busy)
    assert summary["by_op_class"]["ffn"][0] == pytest.approx(6e-6)
    assert summary["unattributed_s"] == pytest.approx(4e-6)  # 14 busy - (4 + 6) named
    assert summary["host_s"] == pytest.approx(6e-6)  # 20 - 14
    assert sum(share for _, share in summary["by_op_class"].values()) == pytest.approx(1.0)
    assert "unattributed" in trace_summary.markdown(summary, "toy")
    totals = trace_summary.thread_totals(events, steps=1)
    assert totals["Stream #7"] == [2, pytest.approx(9e-6)] and list(totals)[0] == "main"
