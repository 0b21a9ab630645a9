"""`python -m train.profile_step [train flags] --out DIR`: profile a few training steps.

Builds the run exactly as `python -m train` would (same flags: preset, attention arm,
batch, sequence length, --scan-layers, --remat, ...), compiles the step (timed), runs
`--warmup` steps, then `--profile-steps` steps under `jax.profiler.trace`, and writes

    DIR/profile.json   seconds per step by layer kind, op class and direction, the step
                       time, tokens/s, model FLOP/s and MFU, compile seconds; on a GPU
                       also its streams' busy time and the trace's timelines (`threads`);
                       the costliest HLO instructions with their shapes (`top_instructions`)
    DIR/profile.md     the same as markdown tables
    DIR/step_hlo.txt.gz  the compiled step's HLO: what each fused instruction computes
    DIR/trace/         the raw profile (TensorBoard / Perfetto / xprof)

On a GPU, XLA runs runs of kernels as CUDA command buffers (graphs), which the trace shows
as one `command_buffer_N` event with no operation names; `--command-buffers off` (the
default here) turns them off so every kernel is attributed to its layer and op class. The
step then pays one launch per kernel, so its time is an upper bound on the training run's.

Example (one H200, a few minutes):

    python -m train.profile_step --preset 569m --seq-len 4096 --batch-size 8 \\
        --attention matched --out docs/profiles/569m-matched
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time

import jax
from flax import nnx

from train import compile_cache, config, optim, parallel, throughput, trace_summary, xla_flags
from train import data as data_lib
from train import loop
from train import model as model_lib


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.profile_step",
        description="Profile training steps; any other flag is a `python -m train` flag.",
    )
    p.add_argument("--out", required=True, help="directory for profile.json, .md and trace/")
    p.add_argument("--warmup", type=int, default=2, help="steps run before profiling")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled")
    p.add_argument(
        "--command-buffers",
        choices=("on", "off"),
        default="off",
        help="XLA's CUDA command buffers; off names every kernel in the trace (default off)",
    )
    return p


def _state(cfg):
    """(model, compiled-ready train_step, params, opt_state, batches, mesh) as in the loop."""
    mesh = parallel.make_mesh(cfg.model_parallel)
    parallel.check_batch(cfg.batch_size, mesh)
    splits = data_lib.load_splits(cfg.data)
    batches, _ = data_lib.make_batches(cfg, splits)
    model = model_lib.default_hooks().build(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    hidden = optim.hidden_matrix_mask(model, params, model.config.vocab_size)
    tx = cfg.optimizer.build(cfg.steps, hidden)
    opt_state = tx.init(params)
    train_step, _ = loop.make_step_fns(graphdef, rest, tx, mesh)
    params, opt_state = parallel.shard_params(params, mesh), parallel.shard_params(opt_state, mesh)
    return model, train_step, params, opt_state, batches, mesh


def profile(cfg, *, out: str, warmup: int = 2, steps: int = 3) -> dict:
    """Profiles `steps` training steps of `cfg` after `warmup` ones; writes DIR/profile.json,
    DIR/profile.md and DIR/trace/ and returns the JSON payload."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"--warmup {warmup} / --profile-steps {steps}: need at least 1 each")
    compile_cache.enable(cfg.compile_cache)
    model, train_step, params, opt_state, batches, mesh = _state(cfg)
    batch = parallel.put_batch(batches.batch(0), mesh)
    with compile_cache.CacheEvents() as events:
        t0 = time.perf_counter()
        compiled = train_step.lower(params, opt_state, batch).compile()
        compile_s = time.perf_counter() - t0
    for i in range(warmup):
        params, opt_state, stats = compiled(params, opt_state, batch)
    jax.block_until_ready(stats)
    trace_dir = os.path.join(out, "trace")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        for i in range(steps):
            params, opt_state, stats = compiled(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, stats))
        wall_s = time.perf_counter() - t0
    trace_events = trace_summary.read_trace(trace_dir)
    hlo_text = compiled.as_text()
    names = trace_summary.op_names(hlo_text)
    ops = trace_summary.op_events(trace_events, "train_step", names)
    if not ops:
        print(f"warning: no operation of the step found in {trace_dir}; the table is host only")
    busy_s = trace_summary.stream_busy(trace_events, "train_step")
    shapes = trace_summary.instruction_shapes(hlo_text)
    summary = trace_summary.summarize(ops, names, wall_s, steps, busy_s=busy_s, shapes=shapes)
    with gzip.open(os.path.join(out, "step_hlo.txt.gz"), "wt") as f:  # the fusions' bodies
        f.write(hlo_text)
    tokens_per_s = cfg.batch_size * cfg.seq_len / summary["step_s"]
    payload = dict(
        preset=cfg.model.name,
        attention=cfg.attention,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        scan_layers=model.config.scan_layers,
        remat=model.config.remat,
        devices=jax.device_count(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        compile_seconds=compile_s,
        compile_cache=events.describe(),
        tokens_per_s=tokens_per_s,
        **throughput.utilisation(throughput.non_embedding_params(model), tokens_per_s),
        **summary,
        threads=trace_summary.thread_totals(trace_events, steps),
    )
    _write(out, payload)
    return payload


def _write(out: str, payload: dict) -> None:
    title = (
        f"{payload['preset']}, attention {payload['attention']}, batch {payload['batch_size']} "
        f"x {payload['seq_len']}, {payload['devices']} x {payload['device_kind']}"
    )
    mfu = payload["mfu"]
    head = (
        f"{payload['tokens_per_s']:,.0f} tokens/s, "
        f"{payload['model_flops_per_s'] / 1e12:.1f} model TFLOP/s (6 N)"
        + (f", MFU {mfu:.1%}" if mfu is not None else "")
        + f"; compile {payload['compile_seconds']:.1f} s ({payload['compile_cache']})\n\n"
    )
    if _command_buffers_off(payload["xla_flags"]):
        head += (
            "Profiled with CUDA command buffers off (every kernel named, launched alone): "
            "where the host's launches outlast the GPU work, the step here is slower than in "
            "`python -m train` (row 'host' shows the gaps); time speed there.\n\n"
        )
    md = trace_summary.markdown(payload, title).replace("\n\n", "\n\n" + head, 1)
    config.write_json_atomic(os.path.join(out, "profile.json"), payload, indent=2)
    with open(os.path.join(out, "profile.md.tmp"), "w") as f:
        f.write(md)
    os.replace(os.path.join(out, "profile.md.tmp"), os.path.join(out, "profile.md"))
    print(md)


def _command_buffers_off(flags: str) -> bool:
    """True where XLA_FLAGS `flags` switch XLA's CUDA command buffers off (an empty list)."""
    return xla_flags.flag_value("xla_gpu_enable_command_buffer", flags) == ""


def _disable_command_buffers() -> None:
    """Must run before jax starts its backend: XLA reads XLA_FLAGS once, at start-up."""
    xla_flags.set_unless_given("xla_gpu_enable_command_buffer", "")


def main(argv=None) -> int:
    args, train_argv = _parser().parse_known_args(argv)
    if args.command_buffers == "off":
        _disable_command_buffers()
    if "--run-dir" not in train_argv:  # nothing is written there; parse_args wants one
        train_argv += ["--run-dir", os.path.join(tempfile.gettempdir(), "profile_step_unused")]
    cfg = config.parse_args(train_argv)
    os.makedirs(args.out, exist_ok=True)
    try:
        profile(cfg, out=args.out, warmup=args.warmup, steps=args.profile_steps)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.join(args.out, 'profile.json')} and profile.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
