"""Run metrics: `metrics.jsonl` (one JSON row per logged step) and TensorBoard event files.

Rows hold `step`, `loss`, `lr`, `grad_norm`, `tokens_per_s`, `val_ce` when evaluated, and per
attention layer `L<i>/max_gain`, `L<i>/top1_share`, `L<i>/top4_share` (QK-norm gain product
statistics) and, when probed, `L<i>/residual_pre` / `L<i>/residual_post` (mean dS row-sum
residual before / after the FP8 cast of dS).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Iterable, Optional

import numpy as np


class TensorBoardWriter:
    """Scalar summaries through `tensorboard.summary.Writer`, tensorboard's own writer API
    (no TensorFlow needed)."""

    def __init__(self, logdir: str):
        from tensorboard.summary import Writer

        self._writer = Writer(logdir)

    def scalars(self, step: int, values: dict, wall_time: Optional[float] = None) -> None:
        for k, v in values.items():
            if (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and k not in ("step", "time")
            ):
                self._writer.add_scalar(k, float(v), int(step), wall_time=wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLog:
    """Appends rows to `<run_dir>/metrics.jsonl` and mirrors scalars to TensorBoard.

    Each row gets `time` (seconds since the epoch). Resuming (`truncate_after=step`) drops
    the rows logged after the checkpoint, which the resumed run logs again, and rewrites the
    TensorBoard events from the rows kept, so no step shows twice."""

    def __init__(
        self, run_dir: str, *, tensorboard: bool = True, truncate_after: Optional[int] = None
    ):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        tb_dir = os.path.join(run_dir, "tensorboard")
        kept = None
        if truncate_after is not None:  # resuming: drop rows logged after the checkpoint
            kept = [r for r in read_metrics(run_dir) if r["step"] <= truncate_after]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                if kept is not None:
                    _remove_event_files(tb_dir)
                self._tb = TensorBoardWriter(tb_dir)
            except ImportError:  # tensorboard not installed: metrics.jsonl only
                self._tb = None
        if self._tb is not None and kept:
            for row in kept:
                self._tb.scalars(row["step"], row, wall_time=row.get("time"))
        self.last: dict = {}

    def write(self, row: dict) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        row.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.scalars(row["step"], row, wall_time=row["time"])
        self.last = row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _remove_event_files(tb_dir: str) -> None:
    """Deletes the TensorBoard event files of `tb_dir` (they mirror metrics.jsonl, which is kept)."""
    if os.path.isdir(tb_dir):
        for name in os.listdir(tb_dir):
            if name.startswith("events.out.tfevents."):
                os.remove(os.path.join(tb_dir, name))


def _clean(v):
    if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "item"):
        v = v.item() if np.size(v) == 1 else np.asarray(v).tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(run_dir: str) -> list[dict]:
    """All rows of a run's metrics.jsonl (empty list if none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def gain_rows(gains: dict, gain_statistics) -> dict:
    """{layer: (g_q, g_k)} -> flat metrics `L<i>/max_gain`, `L<i>/top1_share`, `L<i>/top4_share`."""
    row = {}
    for layer, (g_q, g_k) in sorted(gains.items()):
        stats = gain_statistics(g_q, g_k)
        for name in ("max_gain", "top1_share", "top4_share"):
            row[f"L{layer}/{name}"] = float(np.asarray(stats[name]).max())
    return row


def residual_rows(residuals: dict) -> dict:
    """{layer: {'pre_cast': [B,H,T], 'post_cast': [B,H,T]}} -> mean residual per layer."""
    row = {}
    for layer, res in sorted(residuals.items()):
        row[f"L{layer}/residual_pre"] = float(np.nanmean(np.asarray(res["pre_cast"])))
        row[f"L{layer}/residual_post"] = float(np.nanmean(np.asarray(res["post_cast"])))
    return row


def layer_series(rows: Iterable[dict], suffix: str) -> dict[str, list[tuple[int, float]]]:
    """{'L<i>': [(step, value), ...]} for metric keys ending in `/suffix`."""
    out: dict = {}
    for r in rows:
        for k, v in r.items():
            if k.endswith("/" + suffix) and isinstance(v, (int, float)):
                out.setdefault(k.split("/")[0], []).append((r["step"], v))
    return out
