"""Compile time, the persistent compilation cache and MFU in a run's summary."""

import json
import os
import subprocess
import sys
import types

import pytest

from dm_jax.models import HybridLM, preset
from test_train_standin import HOOKS, tiny_config
from train import compile_cache, loop, throughput, xla_flags


def test_peak_table_and_utilisation():
    assert throughput.dense_bf16_peak("NVIDIA H200") == 989e12
    assert throughput.dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert throughput.dense_bf16_peak("cpu") is None
    h200 = types.SimpleNamespace(device_kind="NVIDIA H200")
    util = throughput.utilisation(303e6, 77_700.0, [h200])
    assert util["model_flops_per_s"] == pytest.approx(6 * 303e6 * 77_700)
    assert util["mfu"] == pytest.approx(6 * 303e6 * 77_700 / 989e12)  # the 14%
    two = throughput.utilisation(303e6, 77_700.0, [h200, h200])
    assert two["mfu"] == pytest.approx(util["mfu"] / 2)
    cpu = throughput.utilisation(1e6, 10.0, [types.SimpleNamespace(device_kind="cpu")])
    assert cpu["mfu"] is None and cpu["model_flops_per_s"] == 6e7


def test_non_embedding_params_leave_out_the_input_embedding():
    from flax import nnx

    cfg = preset("gdn_gqa")
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    assert throughput.non_embedding_params(model) == cfg.num_params() - cfg.vocab_size * cfg.d_model


def test_second_start_loads_the_step_from_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0.0)  # the stand-in is quick
    common = dict(steps=4, log_every=2, eval_every=0, probe_every=0, ckpt_every=0)
    cache = str(tmp_path / "cache")
    runs = [
        loop.train(
            tiny_config(tmp_path / name, compile_cache=cache, **common), progress=True, hooks=HOOKS
        )
        for name in ("first", "second")
    ]
    first, second = (r.compile_cache for r in runs)
    assert first.startswith("compiled") and second == "loaded from the persistent cache"
    assert all(0 < r.compile_seconds < 600 for r in runs)
    out = capsys.readouterr().out
    assert "compile" in out and "loaded from the persistent cache" in out and "MFU" in out
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["compile_cache"] == second and summary["tokens_per_s"] > 0
    assert summary["model_flops_per_s"] > 0 and summary["device_kind"] == "cpu"
    assert summary["state_passes"] == {} and "xla_flags" in summary  # a stand-in model
    assert summary["peak_device_bytes"] is None  # a CPU's allocator does not report it
    off = loop.train(
        tiny_config(tmp_path / "off", compile_cache="off", **common), progress=False, hooks=HOOKS
    )
    assert off.compile_cache.startswith("compiled (persistent cache off")


def test_compile_cache_errors_name_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--compile-cache"):
        compile_cache.enable(str(blocker / "cache"))
    with pytest.raises(ValueError, match="--compile-cache"):
        tiny_config(tmp_path / "run", compile_cache="")


def test_xla_gemm_sets_the_flag_before_the_backend_starts_and_defers_to_xla_flags():
    # a fresh interpreter: XLA_FLAGS only matter before jax's backend starts
    code = (
        "import os, jax; from train import config, xla_flags\n"
        "cfg = config.parse_args(['--run-dir', 'unused', *os.environ['ARGS'].split()])\n"
        "jax.numpy.ones(1).block_until_ready()\n"
        "print(cfg.xla_gemm, '|', os.environ.get('XLA_FLAGS', ''), '|',"
        " xla_flags.use_gemm(cfg.xla_gemm))\n"
    )

    def run(args, xla=None):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(ARGS=args, JAX_PLATFORMS="cpu", **({"XLA_FLAGS": xla} if xla else {}))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return [part.strip() for part in out.stdout.strip().splitlines()[-1].split("|")]

    assert run("") == ["cublas", "--xla_gpu_enable_triton_gemm=false", "cublas"]
    assert run("--xla-gemm triton") == ["triton", "", "triton"]
    user = "--xla_gpu_enable_triton_gemm=true"
    assert run("", xla=user) == ["cublas", user, "triton"]  # the user's XLA_FLAGS win
    assert xla_flags.gemm_in_flags("--a=1 --xla_gpu_enable_triton_gemm=0") == "cublas"
    with pytest.raises(ValueError, match="--xla-gemm"):
        xla_flags.use_gemm("cutlass")
