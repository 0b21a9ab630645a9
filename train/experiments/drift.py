"""Gain-drift stress test: does a consistent gain-gradient bias become drift?

    python -m train.experiments.drift --preset small --arms reference,stale,matched \
        --seeds 0,1 --steps 2000 --chunk-steps 250 --seq-len 8192 --batch-size 4 \
        --qk-gain-lr-ratio 10 --minutes 8 --out DIR

Trains every (arm, seed) from the same initialization and data order per seed, with
settings meant to make gain drift show early: long rows, the query/key RMSNorm gains'
learning rate raised `--qk-gain-lr-ratio` times (gains never get weight decay). A STRESS
TEST, not a production setting. Runs advance together in chunks of `--chunk-steps`: the
run furthest behind goes next, so the runs stay within one chunk of each other. At every
chunk boundary the checkpoint is probed (`drift_probe.probe_checkpoint`: gains, masking
dCE, dS residual ratio stale / matched, attention peakiness).

Resumable: each call works for at most `--minutes` (a run stopped by the limit keeps a
checkpoint) and the same command continues. Writes DIR/setup.json, DIR/runs/<arm>-s<seed>/
(run dirs), DIR/probes/<arm>-s<seed>.jsonl, DIR/drift.png, DIR/residual_ratio.png and
DIR/gaps.png (arm gaps against seed gaps) and DIR/summary.json; `--report-only` rebuilds
the last four.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from typing import Optional, Sequence

from train import checkpoint as ckpt_lib
from train import config as config_lib
from train import loop
from train.experiments import budget as budget_lib
from train.experiments import compare, drift_probe, presets
from train.experiments.hooks import hooks_for

# The flags that define the experiment: a later call must repeat them.
PLAN_FLAGS = (
    "preset",
    "family",
    "arms",
    "seeds",
    "steps",
    "chunk_steps",
    "batch_size",
    "seq_len",
    "lr",
    "qk_gain_lr_ratio",
    "packing",
    "no_qk_norm",
    "attention_implementation",
    "log_every",
    "probe_batches",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.experiments.drift", description=__doc__.split("\n")[0]
    )
    a = p.add_argument
    a("--preset", default="small", help=f"comparison preset: {sorted(presets.PRESETS)}")
    a("--family", default=None, help="model family (default: gdn_gqa)")
    a("--arms", default="reference,stale,do_matched,matched", help="comma-separated arms")
    a("--seeds", default="0,1", help="comma-separated seeds (init and data order)")
    a("--steps", type=int, required=True, help="optimizer steps per run (sets the schedule)")
    a("--chunk-steps", type=int, default=250, help="steps between probes")
    a("--batch-size", type=int, default=None)
    a("--seq-len", type=int, default=None)
    a("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    a("--qk-gain-lr-ratio", type=float, default=10.0, help="QK-norm gain lr / AdamW lr")
    a("--packing", default="concat", choices=config_lib.PACKINGS)
    a("--no-qk-norm", action="store_true", help=argparse.SUPPRESS)  # read by compare
    a("--attention-implementation", default=None, choices=config_lib.IMPLEMENTATIONS)
    a("--log-every", type=int, default=10, help="steps between logged gain statistics")
    a("--probe-batches", type=int, default=2, help="validation batches of the masking probe")
    a("--minutes", type=float, default=8.0, help="work for at most this long, then stop")
    a("--out", required=True, help="experiment directory (runs, probes, plots)")
    a("--report-only", action="store_true", help="rebuild plots and summary.json only")
    return p


def _plan(args) -> dict:
    plan = {flag: getattr(args, flag) for flag in PLAN_FLAGS}
    plan["arms"] = [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        plan["seeds"] = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    for arm in plan["arms"]:
        presets.unavailable_reason(arm, backend="gpu")  # raises on an unknown name
    if not plan["arms"] or len(set(plan["arms"])) != len(plan["arms"]):
        raise ValueError(f"--arms: need distinct arms, got {args.arms!r}")
    if not plan["seeds"] or len(set(plan["seeds"])) != len(plan["seeds"]):
        raise ValueError(f"--seeds: need distinct seeds, got {args.seeds!r}")
    if args.steps < 1 or not 1 <= args.chunk_steps <= args.steps:
        raise ValueError(
            f"--chunk-steps: need 1 <= chunk <= --steps, got {args.chunk_steps}, {args.steps}"
        )
    if args.minutes <= 0:
        raise ValueError(f"--minutes: must be positive, got {args.minutes}")
    return plan


def _check_same_plan(out: str, plan: dict) -> None:
    """Writes DIR/setup.json on the first call; later calls must give the same flags."""
    path = os.path.join(out, "setup.json")
    if not os.path.exists(path):
        os.makedirs(out, exist_ok=True)
        config_lib.write_json_atomic(path, plan, indent=1, sort_keys=True)
        return
    with open(path) as f:
        saved = json.load(f)
    diff = [
        f"--{k.replace('_', '-')}: {saved.get(k)!r} -> {plan[k]!r}"
        for k in plan
        if saved.get(k) != plan[k]
    ]
    if diff:
        raise ValueError(
            f"--out {out!r} holds a drift test with other settings ({'; '.join(diff)}); "
            "repeat its flags to continue it, or choose a new --out"
        )


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def _run_config(args, plan, arm: str, seed: int, run_dir: str, stop_at: int):
    base = presets.get_preset(plan["preset"])
    preset = dataclasses.replace(
        base,
        batch_size=plan["batch_size"] or base.batch_size,
        seq_len=plan["seq_len"] or base.seq_len,
        learning_rate=plan["lr"] or base.learning_rate,
        log_every=plan["log_every"],
        eval_every=plan["chunk_steps"],
        probe_every=0,  # the chunk probe measures every delta mode instead
    )
    run_args = argparse.Namespace(**vars(args))
    run_args.seed = seed
    extra = ["--qk-gain-lr-ratio", str(plan["qk_gain_lr_ratio"]), "--stop-at", str(stop_at)]
    extra += ["--ckpt-every", str(plan["chunk_steps"]), "--keep", "2"]
    if os.path.exists(os.path.join(run_dir, "config.json")):
        extra.append("--resume")
    return compare.make_run_config(run_args, preset, arm, plan["steps"], run_dir, extra=extra)


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _append_jsonl(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=float) + "\n")


class Experiment:
    """The runs of one drift test and where each stands."""

    def __init__(self, args, plan: dict):
        self.args, self.plan, self.out = args, plan, args.out
        self.hooks = hooks_for(plan["packing"])
        self.runs = {}
        for i, seed in enumerate(plan["seeds"]):
            for arm in plan["arms"]:
                name = run_name(arm, seed)
                self.runs[name] = dict(
                    arm=arm,
                    seed=seed,
                    seed_index=i,
                    run_dir=os.path.join(self.out, "runs", name),
                    probes_path=os.path.join(self.out, "probes", f"{name}.jsonl"),
                )
        self.status_path = os.path.join(self.out, "status.json")

    def statuses(self) -> dict:
        if not os.path.exists(self.status_path):
            return {}
        with open(self.status_path) as f:
            return json.load(f)

    def set_status(self, name: str, status: str) -> None:
        statuses = dict(self.statuses(), **{name: status})
        config_lib.write_json_atomic(self.status_path, statuses, indent=1, sort_keys=True)

    def step(self, name: str) -> int:
        steps = ckpt_lib.complete_steps(os.path.join(self.runs[name]["run_dir"], "checkpoints"))
        return steps[-1] if steps else 0

    def reported_step(self, name: str) -> int:
        """step(), or where the run's metrics end when its checkpoints are not here (a run
        copied back without them, read by --report-only)."""
        step = self.step(name)
        if step:
            return step
        path = os.path.join(self.runs[name]["run_dir"], "metrics.jsonl")
        logged = [r.get("step", 0) for r in _read_jsonl(path)] if os.path.exists(path) else []
        return max(logged, default=0)

    def probed(self, name: str) -> set[int]:
        return {r["step"] for r in _read_jsonl(self.runs[name]["probes_path"])}

    def active(self) -> list[str]:
        """Runs that can still train or need a probe, furthest behind first."""
        statuses, out = self.statuses(), []
        for name, run in self.runs.items():
            reason = presets.unavailable_reason(run["arm"], packing=self.plan["packing"])
            if reason:
                if name not in statuses:
                    self.set_status(name, f"not run: {reason}")
                continue
            if statuses.get(name, "").startswith(("diverged", "failed")):
                continue
            step = self.step(name)
            if step < self.plan["steps"] or step not in self.probed(name):
                out.append(name)
        return sorted(out, key=lambda n: (self.step(n), list(self.runs).index(n)))

    def probe_reserve(self) -> float:
        """Seconds kept for a chunk probe: the slowest so far, at least 60."""
        times = [
            r.get("probe_seconds", 0.0)
            for run in self.runs.values()
            for r in _read_jsonl(run["probes_path"])
        ]
        return max([60.0] + times)

    def probe(self, name: str, step: int, log=print) -> None:
        run = self.runs[name]
        log(f"[{name}] probing step {step}")
        try:
            row = drift_probe.probe_checkpoint(
                run["run_dir"], self.hooks, val_batches=self.plan["probe_batches"], log=log
            )
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on without this probe
            traceback.print_exc()
            row = dict(error=f"{type(e).__name__}: {e}")
        _append_jsonl(run["probes_path"], dict(row, step=step, run=name))


def advance(exp: Experiment, name: str, deadline: float, log=print) -> bool:
    """Trains run `name` to its next chunk boundary and probes it there (or only probes it,
    if it stands at an unprobed boundary). False when the deadline stopped the work."""
    run, chunk, total = exp.runs[name], exp.plan["chunk_steps"], exp.plan["steps"]
    step = exp.step(name)
    at_boundary = step > 0 and (step % chunk == 0 or step == total)
    if at_boundary and step not in exp.probed(name):
        if time.time() + exp.probe_reserve() > deadline:
            return False
        exp.probe(name, step, log)
        return True
    target = min(total, (step // chunk + 1) * chunk)
    limit_s = deadline - time.time() - exp.probe_reserve()
    if limit_s <= 0:
        return False
    log(f"[{name}] training steps {step} -> {target} (at most {limit_s:.0f} s)")
    try:
        cfg = _run_config(exp.args, exp.plan, run["arm"], run["seed"], run["run_dir"], target)
        with budget_lib.TimeLimit(limit_s) as limit:
            try:
                result = loop.train(cfg, progress=False, hooks=exp.hooks)
            except KeyboardInterrupt:
                if not limit.fired:
                    raise
                return False
    except loop.NonFiniteLoss as e:
        exp.set_status(name, f"diverged: {e}")
        return True
    except (Exception, SystemExit) as e:  # parse errors are SystemExit
        traceback.print_exc()
        exp.set_status(name, f"failed: {type(e).__name__}: {e}")
        return True
    if result.status == "interrupted":
        if not limit.fired:
            raise KeyboardInterrupt
        return False
    exp.probe(name, result.step, log)
    return True


def summarize(exp: Experiment) -> dict:
    """Per run: status, step, the last probe; per arm and overall: the final max gain at the
    step every run reached, and the seed spread it is to be compared with."""
    statuses, runs = exp.statuses(), {}
    for name, run in exp.runs.items():
        probes = [p for p in _read_jsonl(run["probes_path"]) if "error" not in p]
        step = exp.reported_step(name)
        runs[name] = dict(
            arm=run["arm"],
            seed=run["seed"],
            status=statuses.get(name, "running" if step < exp.plan["steps"] else "done"),
            step=step,
            last_probe={
                k: v for k, v in (probes[-1] if probes else {}).items() if k != "residuals"
            },
        )
    trained = [n for n, r in runs.items() if r["last_probe"]]
    common = min((runs[n]["last_probe"]["step"] for n in trained), default=None)
    at_common = {}
    for name in trained:
        rows = [p for p in _read_jsonl(exp.runs[name]["probes_path"]) if p.get("step") == common]
        if rows and "error" not in rows[0]:
            at_common[name] = rows[0]
    per_arm: dict = {}
    for name, row in at_common.items():
        per_arm.setdefault(runs[name]["arm"], []).append(row)
    keys = ("max_gain", "top1_share", "masking_dce", "residual_ratio_post_mean", "peakiness_max")
    arms = {arm: {k: [r.get(k) for r in rows] for k in keys} for arm, rows in per_arm.items()}
    spreads = [
        max(v["max_gain"]) - min(v["max_gain"]) for v in arms.values() if len(v["max_gain"]) > 1
    ]
    out = dict(common_step=common, runs=runs, arms_at_common_step=arms)
    out["seed_spread_max_gain"] = statistics.mean(spreads) if spreads else None
    if "stale" in arms and "matched" in arms:
        out["stale_minus_matched_max_gain"] = statistics.mean(
            arms["stale"]["max_gain"]
        ) - statistics.mean(arms["matched"]["max_gain"])
    return out


def report(exp: Experiment, log=print) -> dict:
    """summary.json and the plots; prints the per-arm table at the common step."""
    runs = {
        name: dict(run, probes=[p for p in _read_jsonl(run["probes_path"]) if "error" not in p])
        for name, run in exp.runs.items()
        if os.path.exists(os.path.join(run["run_dir"], "metrics.jsonl"))
    }
    summary = summarize(exp)
    if runs:
        summary["plots"] = [
            os.path.basename(p)
            for p in (
                drift_probe.plot_drift(runs, exp.out),
                drift_probe.plot_residual_ratio(runs, exp.out),
                drift_probe.plot_gaps(runs, exp.out),
            )
            if p
        ]
    config_lib.write_json_atomic(
        os.path.join(exp.out, "summary.json"), summary, indent=1, sort_keys=True
    )
    log(f"at step {summary['common_step']} (every run probed there):")
    log(
        f"{'arm':<12} {'max gain':>18} {'top-1 share':>18} {'masking dCE':>18} "
        f"{'stale/matched':>14}"
    )
    fmt = lambda xs: " ".join("-" if x is None else f"{x:.4g}" for x in xs)  # noqa: E731
    for arm, v in summary["arms_at_common_step"].items():
        log(
            f"{arm:<12} {fmt(v['max_gain']):>18} {fmt(v['top1_share']):>18} "
            f"{fmt(v['masking_dce']):>18} {fmt(v['residual_ratio_post_mean']):>14}"
        )
    if summary.get("stale_minus_matched_max_gain") is not None:
        log(
            f"stale - matched max gain: {summary['stale_minus_matched_max_gain']:+.4g} "
            f"(seed spread {summary['seed_spread_max_gain'] or float('nan'):.4g})"
        )
    return summary


def _use_compile_cache(out: str) -> None:
    """A persistent compilation cache under DIR: a continued call (or the next chunk of a
    run) reuses compiled steps instead of compiling again."""
    import jax

    try:
        jax.config.update(
            "jax_compilation_cache_dir", os.path.join(os.path.abspath(out), "jax_cache")
        )
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except (AttributeError, ValueError) as e:  # an older jax without these options
        print(f"no persistent compilation cache ({e})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = _plan(args)
        if not args.report_only:
            _check_same_plan(args.out, plan)
    except ValueError as e:
        parser.error(str(e))
    exp = Experiment(args, plan)
    if not args.report_only:
        _use_compile_cache(args.out)
        deadline, start = time.time() + 60 * args.minutes, time.time()
        while True:
            names = exp.active()
            if not names:
                print("every run is trained and probed")
                break
            if not advance(exp, names[0], deadline):
                print(
                    f"time limit of {args.minutes} min reached after {time.time() - start:.0f} s: "
                    "run the same command again to continue"
                )
                break
    report(exp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
