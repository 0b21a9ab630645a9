"""Device-time budgets: how many steps fit in a per-arm budget, and a hard stop at its end.

`train.loop.train` has no time limit of its own; it stops cleanly (checkpoint, status
"interrupted") on SIGINT. `TimeLimit` sends that signal to this process when the budget is
spent, so an arm that runs slower than calibrated still ends on time with a usable model.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import threading
import time
from typing import Callable, Optional, Sequence

from train import loop, metrics


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured on a short run: steady seconds per optimizer step, and the fixed cost of a
    run (data loading, model set-up, compilation, final checkpoint) in seconds."""

    seconds_per_step: float
    setup_seconds: float


def calibrate(
    make_config: Callable[[int, str, int], object], scratch_dir: str, *, steps: int = 10, hooks=None
) -> Calibration:
    """Trains `steps` steps in `scratch_dir` (deleted afterwards) and times them.

    make_config(steps, run_dir, log_every) -> RunConfig; `hooks` go to `train.loop.train`.
    Logging at `steps // 2` and `steps` makes the second logged tokens/s a steady-state rate
    (compilation falls in the first interval).
    """
    if steps < 4:
        raise ValueError(f"steps: calibration needs >= 4 steps, got {steps}")
    shutil.rmtree(scratch_dir, ignore_errors=True)  # left by an interrupted comparison
    cfg = make_config(steps, scratch_dir, steps // 2)
    start = time.perf_counter()
    try:
        loop.train(cfg, progress=False, hooks=hooks)
        wall = time.perf_counter() - start
        rows = [r for r in metrics.read_metrics(scratch_dir) if "tokens_per_s" in r]
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)
    seconds_per_step = cfg.batch_size * cfg.seq_len / rows[-1]["tokens_per_s"]
    return Calibration(seconds_per_step, max(0.0, wall - steps * seconds_per_step))


def steps_for_budget(
    cal: Calibration, budget_s: float, *, reserve_s: float, margin: float = 0.85
) -> int:
    """Steps that fit in `budget_s` after the run's fixed cost and `reserve_s` (evaluation),
    with `margin` for logging, validation and checkpoints during training."""
    train_s = budget_s - reserve_s - cal.setup_seconds
    steps = int(margin * train_s / cal.seconds_per_step)
    if steps < 1:
        raise ValueError(
            f"--minutes-per-arm: {budget_s / 60:.1f} min leaves no time to train (set-up "
            f"{cal.setup_seconds:.0f} s, evaluation reserve {reserve_s:.0f} s, "
            f"{cal.seconds_per_step:.3f} s/step)"
        )
    return steps


@dataclasses.dataclass(frozen=True)
class Plan:
    """Steps every arm trains; the calibration that set them. `charge_s`: calibration time
    taken from each arm's budget (all of it, shared out over the arms)."""

    steps: int
    calibrations: dict  # arm -> Calibration
    calibration_s: float
    charge_s: float


def plan(
    arms: Sequence[str],
    make_config: Callable[[str, int, str, int], object],
    scratch_dir: str,
    *,
    budget_s: float,
    reserve_s: float,
    calibration_steps: int = 10,
    every_arm: bool = True,
    hooks=None,
    log: Callable[[str], None] = print,
) -> Optional[Plan]:
    """Calibrates `arms` (every one, or only the first that trains) and returns the largest
    step count that fits every calibrated arm into `budget_s` (None if none could train).

    make_config(arm, steps, run_dir, log_every) -> RunConfig.
    """
    start, calibrations = time.perf_counter(), {}
    for arm in arms:
        if calibrations and not every_arm:
            break
        log(f"calibrating {arm} ({calibration_steps} steps)")
        try:
            cal = calibrate(
                functools.partial(make_config, arm),
                scratch_dir,
                steps=calibration_steps,
                hooks=hooks,
            )
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the arm's own run reports it again
            log(f"  calibration of {arm} failed ({type(e).__name__}: {e})")
            continue
        calibrations[arm] = cal
        log(f"  {cal.seconds_per_step:.3f} s/step, set-up {cal.setup_seconds:.0f} s")
    if not calibrations:
        return None
    calibration_s = time.perf_counter() - start
    charge_s = calibration_s / len(arms)
    steps = min(
        steps_for_budget(c, budget_s - charge_s, reserve_s=reserve_s) for c in calibrations.values()
    )
    return Plan(steps, calibrations, calibration_s, charge_s)


class TimeLimit:
    """Context manager: after `seconds`, send SIGINT to this process (once) and set `fired`.

    Meant to wrap `train.loop.train`, which turns SIGINT into a clean stop. A limit of None
    or <= 0 never fires."""

    def __init__(self, seconds):
        self.seconds, self.fired = seconds, False
        self._timer = None

    def _fire(self):
        self.fired = True
        os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self):
        if self.seconds is not None and self.seconds > 0:
            self._timer = threading.Timer(self.seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        return False
