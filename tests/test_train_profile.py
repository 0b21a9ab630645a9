"""`python -m train.profile_step`: a profiled step summarised by layer kind and op class."""

import gzip
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
    hlo = compiled.as_text()
    shapes = trace_summary.instruction_shapes(hlo)
    summary = trace_summary.summarize(ops, trace_summary.op_names(hlo), 1.0, 2, shapes=shapes)
    shares = summary["by_op_class"]
    assert shares["mixer"][0] > 0 and shares["ffn"][0] > 0
    assert sum(share for _, share in shares.values()) == pytest.approx(1.0)
    assert summary["by_direction"]["backward"][0] > 0
    assert any("ffn" in name for name in summary["top_op_names"])
    top = summary["top_instructions"]
    assert sum(secs for secs, *_ in top.values()) == pytest.approx(summary["op_s"])
    assert all(n >= 1 for _, n, _, _ in top.values())
    assert any(
        shape.startswith("f32[256,256]") and "ffn" in name for _, _, name, shape in top.values()
    )
    md = trace_summary.markdown(summary, "toy")
    assert "| mixer |" in md and "| host |" in md and "| instruction |" in md


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
    assert "command buffers off" in md  # its tokens/s may be launch-bound: the header says so
    with gzip.open(out / "step_hlo.txt.gz", "rt") as f:
        hlo = f.read()
    assert "ENTRY" in hlo and all(op in hlo for op in payload["top_instructions"])
    assert "tokens/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_step.main(["--preset", "gqa-tiny"])  # --out is required


def test_op_events_read_an_xla_ops_timeline_and_skip_enclosing_loops():
    def event(name, ts, dur, thread, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=thread, thread=thread, args=args)

    events = [
        event("while.3", 0.0, 10.0, "XLA Ops"),  # spans its body's operations
        event("fusion.1", 1.0, 4.0, "XLA Ops"),
        event("fusion.2", 5.0, 3.0, "XLA Ops"),
        event("other.9", 20.0, 2.0, "XLA Ops", hlo_op="other.9", hlo_module="jit_eval_step"),
    ]
    ops = trace_summary.op_events(events, "train_step")
    assert sorted(e["args"]["hlo_op"] for e in ops) == ["fusion.1", "fusion.2"]
    names = {"fusion.1": "jit(train_step)/jvp(gdn)/mixer/dot", "fusion.2": "x/optimizer/add"}
    summary = trace_summary.summarize(ops, names, wall_s=10e-6, steps=1)
    assert summary["by_op_class"]["mixer"][0] == pytest.approx(4e-6)
    assert summary["by_op_class"]["optimizer"][0] == pytest.approx(3e-6)
    assert summary["host_s"] == pytest.approx(3e-6)


def test_command_buffers_off_is_read_from_the_flags():
    assert profile_step._command_buffers_off("--a=1 --xla_gpu_enable_command_buffer=")
    assert not profile_step._command_buffers_off("--xla_gpu_enable_command_buffer=FUSION")
    assert not profile_step._command_buffers_off("")


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


def test_stream_kernels_are_named_by_annotation_launch_or_kernel_name():
    """On a GPU the kernels on its streams are the device time: named by their own hlo_op,
    by the host event that launched them (a library kernel such as cuBLAS's), or by the
    fusion their kernel name spells; a kernel none of these name is listed by its name."""

    def event(name, ts, dur, thread, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=thread, thread=thread, args=args)

    module = dict(hlo_module="jit_train_step")
    events = [
        event("thunk", 4.0, 8.0, "host", hlo_op="custom-call.2", **module),
        event("cuLaunchKernel", 4.5, 0.5, "host", correlation_id=7),
        event("python", 0.0, 20.0, "main"),
        event("fusion.1", 0.5, 3.0, "Stream #7", hlo_op="fusion.1", **module),
        event("sm90_xmma_gemm_bf16", 5.0, 6.0, "Stream #7", correlation_id=7),
        event("loop_add_fusion_3", 12.0, 2.0, "Stream #7"),
        event("mystery_kernel", 15.0, 2.0, "Stream #9"),
        event("other_module", 18.0, 1.0, "Stream #7", hlo_op="x.1", hlo_module="jit_eval"),
    ]
    names = {
        "fusion.1": "jit(train_step)/jvp(gdn)/mixer/x",
        "custom-call.2": "jit(train_step)/jvp(gdn)/ffn/dot_general",
        "loop_add_fusion.3": "jit(train_step)/optimizer/add",
    }
    ops = trace_summary.op_events(events, "train_step", names)
    assert [e["args"]["hlo_op"] for e in ops] == [
        "fusion.1",
        "custom-call.2",
        "loop_add_fusion.3",
        "mystery_kernel",
    ]
    busy = trace_summary.stream_busy(events, "train_step")
    assert busy == pytest.approx(13e-6)
    assert trace_summary.stream_busy(events[:3], "train_step") is None  # no GPU timeline
    summary = trace_summary.summarize(ops, names, wall_s=20e-6, steps=1, busy_s=busy)
    classes = summary["by_op_class"]
    assert classes["ffn"][0] == pytest.approx(6e-6) and classes["mixer"][0] == pytest.approx(3e-6)
    assert classes["optimizer"][0] == pytest.approx(2e-6)
    assert summary["unnamed_ops"] == {"mystery_kernel": pytest.approx(2e-6)}
    assert summary["unattributed_s"] == 0.0 and summary["host_s"] == pytest.approx(7e-6)
    assert sum(share for _, share in classes.values()) == pytest.approx(1.0)
    totals = trace_summary.thread_totals(events, steps=1)
    assert totals["Stream #7"] == [4, pytest.approx(12e-6)] and list(totals)[0] == "main"


def test_kernel_time_beyond_the_named_operations_is_unattributed_not_host():
    ops = [dict(ph="X", ts=0.0, dur=4.0, thread="Stream #7", args=dict(hlo_op="fusion.1"))]
    names = {"fusion.1": "jit(train_step)/jvp(gdn)/mixer/x"}
    summary = trace_summary.summarize(ops, names, wall_s=20e-6, steps=1, busy_s=14e-6)
    assert summary["unattributed_s"] == pytest.approx(10e-6)  # 14 busy - 4 named
    assert summary["host_s"] == pytest.approx(6e-6)  # 20 - 14
    assert sum(share for _, share in summary["by_op_class"].values()) == pytest.approx(1.0)
    assert "unattributed" in trace_summary.markdown(summary, "toy")
