"""Train every attention arm from one initialization and data order, evaluate, report.

    python -m train.experiments.compare --preset small \
        --arms reference,stale,do_matched,matched,cudnn_fp8 --minutes-per-arm 4 \
        --out docs/experiments/small-h200

Writes into --out: report.md, loss.png, max_gain.png, top_share.png, residual.png,
results/<arm>.json and metrics/<arm>/metrics.jsonl. Run directories (checkpoints) go to
--runs-dir (default runs/compare/<name of --out>). Arms that cannot run here are reported as
not run, with why. docs/experiments/README.md describes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

from rich.console import Console

from train import config as config_lib
from train import loop, metrics, plot
from train.experiments import budget as budget_lib
from train.experiments import evaluate, presets, report
from train.experiments.hooks import hooks_for

console = Console()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.experiments.compare", description=__doc__.split("\n")[0]
    )
    a = p.add_argument
    a("--preset", default="small", help=f"comparison preset: {sorted(presets.PRESETS)}")
    a("--family", default=None, help="model family (default: the train default, gdn_gqa)")
    a(
        "--arms",
        default=",".join(presets.DEFAULT_ARMS),
        help=f"comma-separated, from {presets.ARMS}",
    )
    a("--out", required=True, help="report directory, e.g. docs/experiments/NAME")
    a(
        "--runs-dir",
        default=None,
        help="where run dirs and checkpoints go (default runs/compare/<out name>)",
    )
    a(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per arm (default: the preset's; "
        "with --minutes-per-arm: at most this many)",
    )
    a(
        "--minutes-per-arm",
        type=float,
        default=None,
        help="device-time budget per arm (training + evaluation); steps are calibrated to fit",
    )
    a(
        "--eval-minutes",
        type=float,
        default=None,
        help="part of each arm's budget kept for evaluation (default: a quarter of it, at least 1)",
    )
    a("--calibration-steps", type=int, default=10)
    a(
        "--calibrate",
        default="all",
        choices=("all", "first"),
        help="with --minutes-per-arm: time every arm (the slowest sets the step count) or only the first",
    )
    a("--seed", type=int, default=0, help="initialization and data-order seed, shared by all arms")
    a(
        "--packing",
        default="concat",
        choices=config_lib.PACKINGS,
        help="training windows: plain concatenation (default; cuDNN FP8 attention takes no document "
        "ids) or document segments",
    )
    a("--no-qk-norm", action="store_true", help="the no-QK-norm model variant")
    a("--batch-size", type=int, default=None)
    a("--seq-len", type=int, default=None)
    a("--lr", type=float, default=None)
    a("--attention-implementation", default=None, choices=config_lib.IMPLEMENTATIONS)
    a(
        "--ruler-lengths",
        default=None,
        help="comma-separated context lengths (default: the preset's)",
    )
    a("--ruler-examples", type=int, default=None, help="examples per task and length")
    a("--no-generate", action="store_true", help="skip greedy decoding (likelihood scores only)")
    a("--skip-done", action="store_true", help="keep arms whose results/<arm>.json says done")
    a(
        "--report-only",
        action="store_true",
        help="rebuild report.md and plots from results/ and metrics/",
    )
    a("--no-progress", action="store_true", help="no progress bar; print metrics rows as they come")
    return p


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    for arm in arms:
        presets.unavailable_reason(
            arm, backend="gpu", packing="concat"
        )  # raises on an unknown name
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"--arms: need distinct arms, got {text!r}")
    return arms


def _preset(args) -> presets.ComparePreset:
    p = presets.get_preset(args.preset)
    ruler = p.ruler
    if args.ruler_lengths:
        try:
            lengths = tuple(int(n) for n in args.ruler_lengths.split(","))
        except ValueError:
            raise ValueError(
                f"--ruler-lengths: expected comma-separated integers, got {args.ruler_lengths!r}"
            )
        ruler = dataclasses.replace(ruler, context_lengths=lengths)
    if args.ruler_examples:
        ruler = dataclasses.replace(ruler, examples=args.ruler_examples)
    if args.no_generate:
        ruler = dataclasses.replace(ruler, generate=False)
    return dataclasses.replace(
        p,
        ruler=ruler,
        batch_size=args.batch_size or p.batch_size,
        seq_len=args.seq_len or p.seq_len,
        learning_rate=args.lr or p.learning_rate,
    )


def make_run_config(
    args,
    preset: presets.ComparePreset,
    arm: str,
    steps: int,
    run_dir: str,
    log_every: Optional[int] = None,
    extra: Sequence[str] = (),
) -> config_lib.RunConfig:
    """The RunConfig of one arm: everything but `--attention` is shared by all arms.
    `extra`: further `python -m train` flags (they win over the ones set here)."""
    model = f"{args.family}-{preset.model_preset}" if args.family else preset.model_preset
    every = min(preset.eval_every, steps)
    argv = [
        "--preset",
        model,
        "--attention",
        arm,
        "--steps",
        str(steps),
        "--seed",
        str(args.seed),
        "--run-dir",
        run_dir,
        "--batch-size",
        str(preset.batch_size),
        "--seq-len",
        str(preset.seq_len),
        "--log-every",
        str(log_every or min(preset.log_every, steps)),
        "--eval-every",
        str(every),
        "--probe-every",
        str(min(preset.probe_every, steps)),
        "--packing",
        args.packing,
        "--ckpt-every",
        str(max(1, steps // 4)),
        "--keep",
        "1",
    ]
    argv += ["--lr", str(preset.learning_rate)] if preset.learning_rate else []
    argv += ["--qk-norm", "off"] if args.no_qk_norm else []
    impl = args.attention_implementation
    argv += ["--attention-implementation", impl] if impl else []
    return config_lib.parse_args(argv + list(extra))


def _train_summary(rows: Sequence[dict]) -> dict:
    """Final train CE (mean of logged losses over the last 10% of steps) and median tokens/s."""
    losses = [
        r["loss"]
        for r in rows
        if isinstance(r.get("loss"), (int, float)) and r["step"] >= 0.9 * rows[-1]["step"]
    ]
    speeds = [r["tokens_per_s"] for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    return dict(
        train_ce=statistics.mean(losses) if losses else None,
        tokens_per_s=statistics.median(speeds[1:] or speeds) if speeds else None,
    )


class _EchoMetrics:
    """While training: print each new metrics row of `run_dir` every `seconds` (for logs,
    where the progress bar of a terminal does not draw)."""

    def __init__(self, run_dir: str, label: str, seconds: float = 20.0):
        self.run_dir, self.label, self.seconds = run_dir, label, seconds
        self._stop, self._seen = threading.Event(), 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.seconds):
            self.echo()

    def echo(self):
        for r in metrics.read_metrics(self.run_dir)[self._seen :]:
            self._seen += 1
            shown = "".join(
                f"  {k} {report.fmt(r.get(k), '.4g')}"
                for k in ("loss", "val_ce", "tokens_per_s")
                if k in r
            )
            console.print(f"  [{self.label}] step {r['step']}{shown}")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.echo()
        return False


EVALUATION_INCOMPLETE = "trained, evaluation incomplete"


def run_arm(
    args, preset, arm: str, steps: int, run_dir: str, train_limit_s: Optional[float], save=None
) -> dict:
    """Trains and evaluates one arm; failures are recorded in the result, not raised
    (except a user's Ctrl-C). `save(result)` (optional) is given a provisional result after
    training and after every evaluation part, so a process stopped mid-evaluation keeps
    what it measured."""
    result = dict(arm=arm, status="done", reason=None, steps=None)
    reason = presets.unavailable_reason(arm, packing=args.packing)
    if reason:
        return dict(result, status="not run", reason=reason)
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)  # a stale run of an earlier comparison: start over
    start = time.perf_counter()
    try:
        cfg = make_run_config(args, preset, arm, steps, run_dir)
        show_bar = not args.no_progress and sys.stdout.isatty()
        echo = _EchoMetrics(run_dir, arm) if not show_bar else contextlib.nullcontext()
        with budget_lib.TimeLimit(train_limit_s) as limit, echo:
            try:
                trained = loop.train(cfg, progress=show_bar, hooks=hooks_for(args.packing))
            except KeyboardInterrupt:
                if not limit.fired:
                    raise
                return dict(
                    result,
                    status="failed",
                    reason="the time budget ran out before training started",
                )
        if trained.status == "interrupted" and not limit.fired:
            raise KeyboardInterrupt
        if trained.status == "interrupted":
            result.update(
                status="stopped by time budget", reason=f"stopped at step {trained.step} of {steps}"
            )
        result["steps"] = trained.step
    except loop.NonFiniteLoss as e:
        result.update(status="diverged", reason=str(e))
    except (Exception, SystemExit) as e:  # parse_args reports bad flags as SystemExit
        traceback.print_exc()
        return dict(result, status="failed", reason=f"{type(e).__name__}: {e}")
    result["train_seconds"] = time.perf_counter() - start
    rows = metrics.read_metrics(run_dir)
    if rows:
        result.update(_train_summary(rows), steps=result["steps"] or rows[-1]["step"])
    start = time.perf_counter()

    def keep(parts: dict):  # provisional record until the evaluation returns
        if save is not None:
            note = "the evaluation did not finish (the process was stopped)"
            save(
                dict(
                    result,
                    **parts,
                    status=EVALUATION_INCOMPLETE
                    if result["status"] == "done"
                    else result["status"],
                    reason=(result["reason"] + "; " if result["reason"] else "") + note,
                    eval_seconds=time.perf_counter() - start,
                )
            )

    keep({})
    try:
        result.update(
            evaluate.evaluate_run(
                run_dir, preset, log=console.print, hooks=hooks_for(args.packing), on_part=keep
            )
        )
    except Exception as e:  # e.g. a diverged run without a checkpoint
        traceback.print_exc()
        result["reason"] = (
            result["reason"] + "; " if result["reason"] else ""
        ) + f"evaluation failed: {e}"
    result["eval_seconds"] = time.perf_counter() - start
    return result


def _write_json(path: str, payload) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    config_lib.write_json_atomic(path, payload, indent=1, sort_keys=True, default=str)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _plan_steps(args, preset, arms: Sequence[str], runs_dir: str) -> tuple[int, float, dict]:
    """(steps per arm, evaluation reserve in s, budget notes); calibrates under a budget."""
    if args.minutes_per_arm is None:
        return args.steps or preset.steps, 0.0, {}
    budget_s = 60 * args.minutes_per_arm
    reserve_s = 60 * args.eval_minutes if args.eval_minutes is not None else max(60.0, budget_s / 4)
    runnable = [a for a in arms if presets.unavailable_reason(a, packing=args.packing) is None]
    p = budget_lib.plan(
        runnable,
        lambda arm, steps, run_dir, log_every: make_run_config(
            args, preset, arm, steps, run_dir, log_every
        ),
        os.path.join(runs_dir, "_calibration"),
        budget_s=budget_s,
        reserve_s=reserve_s,
        calibration_steps=args.calibration_steps,
        every_arm=args.calibrate == "all",
        hooks=hooks_for(args.packing),
        log=console.print,
    )
    if p is None:
        return args.steps or preset.steps, reserve_s, {}
    steps = min(p.steps, args.steps) if args.steps else p.steps
    console.print(f"{steps} steps per arm")
    speeds = ", ".join(
        f"{a} {c.seconds_per_step:.3f} s/step (set-up {c.setup_seconds:.0f} s)"
        for a, c in p.calibrations.items()
    )
    return (
        steps,
        reserve_s,
        dict(budget_s=budget_s, calibration_s=p.calibration_s, charge_s=p.charge_s, speeds=speeds),
    )


def _setup_lines(args, preset, steps: int, notes: dict) -> list[str]:
    import jax

    device = jax.devices()[0]
    lines = [
        f"Command: `python -m train.experiments.compare {' '.join(sys.argv[1:])}`",
        f"Preset `{args.preset}` (model `{(args.family + '-') if args.family else ''}{preset.model_preset}`, "
        f"QK-norm {'off' if args.no_qk_norm else 'as preset'}), batch {preset.batch_size} x {preset.seq_len}, "
        f"{steps} steps per arm, seed {args.seed} (same initialization and data order for every arm), "
        f"{args.packing} packing",
        f"Device: {jax.default_backend()} ({getattr(device, 'device_kind', device)}), "
        f"jax {jax.__version__}; written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"Long-context suite: tasks {', '.join(preset.ruler.tasks)}; lengths "
        f"{', '.join(map(str, preset.ruler.context_lengths))}; {preset.ruler.examples} examples each",
    ]
    if notes:
        lines.append(
            f"Budget: {notes['budget_s'] / 60:.1f} min per arm; calibration {notes['calibration_s']:.0f} s: "
            f"{notes['speeds']}"
        )
    return lines


def finish(out: str, arms: Sequence[str], setup: Sequence[str]) -> str:
    """Plots and report.md from results/<arm>.json and metrics/<arm>/metrics.jsonl under `out`."""
    results = [
        _read_json(os.path.join(out, "results", f"{a}.json"))
        for a in arms
        if os.path.exists(os.path.join(out, "results", f"{a}.json"))
    ]
    logged = [
        os.path.join(out, "metrics", r["arm"])
        for r in results
        if metrics.read_metrics(os.path.join(out, "metrics", r["arm"]))
    ]
    try:
        made = plot.plot_runs(logged, out) if logged else []
    except Exception:  # noqa: BLE001 - a report without plots beats none
        traceback.print_exc()
        made = []
    title = f"Attention arms compared: {os.path.basename(os.path.abspath(out))}"
    return report.write_report(
        os.path.join(out, "report.md"),
        results,
        title=title,
        setup=setup,
        plots={os.path.splitext(os.path.basename(p))[0]: p for p in made},
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        arms = _arms(args.arms)
        preset = _preset(args)
        if args.minutes_per_arm is not None and args.minutes_per_arm <= 0:
            raise ValueError(f"--minutes-per-arm: must be positive, got {args.minutes_per_arm}")
    except ValueError as e:
        parser.error(str(e))
    out = args.out
    runs_dir = args.runs_dir or os.path.join(
        "runs", "compare", os.path.basename(os.path.abspath(out))
    )
    os.makedirs(out, exist_ok=True)
    if args.report_only:
        setup = _read_json(os.path.join(out, "setup.json"))["lines"]
        console.print(f"report: {finish(out, arms, setup)}")
        return 0
    setup_path = os.path.join(out, "setup.json")
    if args.skip_done and os.path.exists(setup_path):  # continue: same steps as the arms kept
        saved = _read_json(setup_path)
        steps, reserve_s, notes, setup = (
            saved["steps"],
            saved["reserve_s"],
            saved["notes"],
            saved["lines"],
        )
        console.print(f"continuing the comparison in {out}: {steps} steps per arm")
    else:
        steps, reserve_s, notes = _plan_steps(args, preset, arms, runs_dir)
        setup = _setup_lines(args, preset, steps, notes)
        _write_json(
            setup_path, dict(lines=setup, arms=arms, steps=steps, reserve_s=reserve_s, notes=notes)
        )
    for i, arm in enumerate(arms):
        path = os.path.join(out, "results", f"{arm}.json")
        if args.skip_done and os.path.exists(path) and _read_json(path)["status"] == "done":
            console.print(f"[dim]{arm}: kept from an earlier run[/dim]")
            continue
        console.rule(f"[bold]arm {i + 1}/{len(arms)}: {arm}[/bold] ({steps} steps)")
        limit = (
            notes["budget_s"] - reserve_s - notes["charge_s"] if notes else None
        )  # training time
        run_dir, logged = os.path.join(runs_dir, arm), os.path.join(out, "metrics", arm)
        shutil.rmtree(logged, ignore_errors=True)  # from an earlier comparison

        def save(result, path=path, run_dir=run_dir, logged=logged):
            if os.path.exists(
                os.path.join(run_dir, "metrics.jsonl")
            ):  # plots are labelled by folder
                os.makedirs(logged, exist_ok=True)
                shutil.copy(os.path.join(run_dir, "metrics.jsonl"), logged)
            _write_json(path, result)

        result = run_arm(args, preset, arm, steps, run_dir, limit, save=save)
        save(result)
        console.print(
            f"{arm}: {result['status']}"
            + (f" ({result['reason']})" if result.get("reason") else "")
        )
        finish(out, arms, setup)  # a report after every arm: a killed run still leaves one
    path = finish(out, arms, setup)
    with open(path) as f:
        table = f.read().split("## Summary\n\n")[1].split("\n\n")[0]
    console.print(table, soft_wrap=True)
    console.print(f"[bold]report:[/bold] {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
