"""What a drift stress test reads at every chunk boundary, and its plots.

`probe_checkpoint(run_dir)` loads a run's newest checkpoint and measures: the QK-norm gain
statistics (max gain, top-1 share), validation CE and the masking probe (CE increase when
the last attention layer is zeroed), the dS row-sum residual of every delta mode on the
model's own attention inputs (post-cast ratio stale / matched, the seed's kernel probe), and
attention peakiness (mean over rows of max_j P_ij).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dm_jax.diagnostics import attention_peakiness
from train import data as data_lib
from train import loop
from train.eval import masking_probe
from train.experiments import evaluate
from train.experiments.presets import ComparePreset
from train.metrics import layer_series, read_metrics


def _peakiness(model, hooks, batch) -> dict[int, float]:
    """Mean over rows, heads and sequences of max_j P_ij, per attention layer."""
    captured = hooks.attention_probe(
        model, jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"]), segment_ids=None
    )
    peak = jax.jit(lambda q, k: jnp.mean(attention_peakiness(q, k, causal=True)))
    return {int(layer): float(peak(x["q"], x["k"])) for layer, x in sorted(captured.items())}


def probe_checkpoint(
    run_dir: str, hooks, *, val_batches: int = 2, probe_rows: int = 1, log: Callable = print
) -> dict:
    """One JSON-ready row of chunk-boundary measurements of `run_dir`'s newest checkpoint."""
    start = time.perf_counter()
    model, cfg = loop.load_model(run_dir, hooks=hooks)
    _, val = data_lib.make_batches(cfg, data_lib.load_splits(cfg.data), validation=True)
    batches = [dict(val.batch(i), segments=None) for i in range(val_batches)]
    gains = evaluate.final_gains(model, hooks)
    row = dict(
        max_gain=max((g["max_gain"] for g in gains.values()), default=None),
        top1_share=max((g["top1_share"] for g in gains.values()), default=None),
        gains={str(k): v for k, v in gains.items()},
    )
    layers = list(cfg.model_config.attention_layer_indices)
    if layers:
        masked = masking_probe(evaluate.model_logits_fn(model), batches, layers[-1])
        row.update(val_ce=masked.ce, masking_dce=masked.increase)
    preset = ComparePreset(cfg.model.size, cfg.batch_size, cfg.seq_len, 1, probe_rows=probe_rows)
    impl = dict(cfg.model.overrides).get("attention_implementation")
    residuals = evaluate._residuals_or_reference(model, cfg, preset, batches, hooks, impl, log)
    ratio = residuals.get("residual_ratio_post", {})
    row.update(
        residual_ratio_post={str(k): v for k, v in ratio.items()},
        residual_ratio_post_mean=float(np.mean(list(ratio.values()))) if ratio else None,
        residuals=residuals.get("residuals", []),
    )
    if hooks.attention_probe is not None:
        first = {k: v[:probe_rows] for k, v in batches[0].items() if v is not None}
        peak = _peakiness(model, hooks, first)
        row.update(peakiness={str(k): v for k, v in peak.items()})
        row["peakiness_max"] = max(peak.values(), default=None)
    row["probe_seconds"] = time.perf_counter() - start
    return row


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------
ARM_COLORS = {
    "reference": "k",
    "bf16": "tab:gray",
    "stale": "tab:red",
    "do_matched": "tab:orange",
    "matched": "tab:blue",
    "cudnn_fp8": "tab:green",
    "cudnn_bf16": "tab:olive",
}
SEED_STYLES = ("-", "--", ":", "-.")


def _worst_layer(rows, suffix) -> tuple[list, list]:
    """(steps, max over attention layers of `L<i>/<suffix>`) from metrics rows."""
    by_step: dict = {}
    for pts in layer_series(rows, suffix).values():
        for step, v in pts:
            by_step[step] = max(v, by_step.get(step, -np.inf))
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_drift(runs: dict, out_dir: str) -> Optional[str]:
    """drift.png: max QK gain, top-1 share (worst layer, every logged step) and masking dCE
    (every chunk) per run. runs: {name: dict(arm=, seed=, run_dir=, probes=[rows])}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, run in sorted(runs.items()):
        style = dict(
            color=ARM_COLORS.get(run["arm"], None),
            ls=SEED_STYLES[run["seed_index"] % len(SEED_STYLES)],
            label=name,
        )
        rows = read_metrics(run["run_dir"])
        for ax, suffix in zip(axes[:2], ("max_gain", "top1_share")):
            ax.plot(*_worst_layer(rows, suffix), **style)
        probes = [p for p in run["probes"] if p.get("masking_dce") is not None]
        axes[2].plot(
            [p["step"] for p in probes], [p["masking_dce"] for p in probes], marker="o", **style
        )
    titles = ("max QK-norm gain (worst layer)", "top-1 share of sum (g_q g_k)^2", "masking dCE")
    for ax, title in zip(axes, titles):
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Stress test (raised QK-gain learning rate): not a production setting")
    return _save(fig, out_dir, "drift.png")


def _save(fig, out_dir: str, name: str) -> str:
    """Writes the figure to out_dir/name and closes it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


GAP_PAIRS = (("stale", "matched"), ("do_matched", "matched"), ("matched", "reference"))


def plot_gaps(runs: dict, out_dir: str) -> Optional[str]:
    """gaps.png: is a gap between arms larger than the gap between seeds? Per logged step,
    the worst layer's max QK-norm gain of one arm minus another's on the same seed (colour),
    and of one arm's seed minus its first seed (grey: the noise). None without a pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}  # (arm, seed) -> {step: worst max gain}
    for run in runs.values():
        steps, values = _worst_layer(read_metrics(run["run_dir"]), "max_gain")
        series[(run["arm"], run["seed"])] = dict(zip(steps, values))

    def gap(a, b):
        common = sorted(set(a) & set(b))
        return common, [a[s] - b[s] for s in common]

    seeds = sorted({seed for _, seed in series})
    lines = []
    for first, second in GAP_PAIRS:
        for (arm, seed), values in sorted(series.items()):
            if arm == first and (second, seed) in series:
                label = f"{first} - {second}, seed {seed}"
                style = dict(color=ARM_COLORS.get(first), ls=SEED_STYLES[seeds.index(seed) % 4])
                lines.append((label, style, gap(values, series[(second, seed)])))
    noise = []
    for arm in sorted({arm for arm, _ in series}):
        seeds = sorted(seed for a, seed in series if a == arm)
        for seed in seeds[1:]:
            label = f"{arm}: seed {seed} - seed {seeds[0]}"
            noise.append((label, gap(series[(arm, seed)], series[(arm, seeds[0])])))
    if not lines and not noise:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, style, (steps, values) in lines:
        ax.plot(steps, values, label=label, **style)
    for n, (label, (steps, values)) in enumerate(noise):
        ax.plot(steps, values, color="0.6", lw=0.8, ls=SEED_STYLES[n % 4], label=label)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set(
        title="max QK-norm gain (worst layer): gaps between arms (same seed) and seeds (grey)",
        xlabel="step",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "gaps.png")


def plot_residual_ratio(runs: dict, out_dir: str) -> Optional[str]:
    """residual_ratio.png: post-cast dS residual ratio stale / matched (mean over layers) on
    each run's own activations, against the step and against the top-1 gain share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, run in sorted(runs.items()):
        probes = [p for p in run["probes"] if p.get("residual_ratio_post_mean") is not None]
        if not probes:
            continue
        style = dict(
            color=ARM_COLORS.get(run["arm"], None),
            ls=SEED_STYLES[run["seed_index"] % len(SEED_STYLES)],
            marker="o",
            label=name,
        )
        ratio = [p["residual_ratio_post_mean"] for p in probes]
        axes[0].plot([p["step"] for p in probes], ratio, **style)
        axes[1].plot([p["top1_share"] for p in probes], ratio, **style)
        axes[2].plot([p["peakiness_max"] for p in probes], ratio, **style)
    labels = ("step", "top-1 gain share (worst layer)", "attention peakiness max_j P_ij")
    for ax, xlabel in zip(axes, labels):
        ax.set(title="post-cast dS residual, stale / matched", xlabel=xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out_dir, "residual_ratio.png")
