"""`python -m train.plot RUN_DIR [RUN_DIR...] [--out DIR]`: PNG plots that compare runs.

Writes loss.png (training loss and validation CE), max_gain.png (max QK-norm gain product per
attention layer) and top_share.png (top-1 / top-4 channel share of sum (g_q g_k)^2) into
--out (default: the first run dir's plots/).
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from train.metrics import layer_series, read_metrics  # noqa: E402


def _label(run_dir: str) -> str:
    return os.path.basename(os.path.normpath(run_dir))


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(runs: dict, out_dir: str) -> str:
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        ax_train.plot(*_series(rows, "loss"), label=name)
        steps, val = _series(rows, "val_ce")
        if steps:
            ax_val.plot(steps, val, marker="o", label=name)
    ax_train.set(title="training loss", xlabel="step", ylabel="cross entropy (nats/token)")
    ax_val.set(title="validation CE", xlabel="step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out_dir, "loss.png")


def plot_layers(runs: dict, out_dir: str, suffixes: tuple[str, ...], name: str, title: str) -> str:
    fig, axes = plt.subplots(1, len(suffixes), figsize=(5.5 * len(suffixes), 4), squeeze=False)
    for ax, suffix in zip(axes[0], suffixes):
        for run, rows in runs.items():
            for layer, pts in sorted(layer_series(rows, suffix).items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{run} {layer}")
        ax.set(title=f"{title}: {suffix}", xlabel="step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out_dir, name)


def plot_runs(run_dirs, out_dir=None) -> list[str]:
    """Writes the comparison PNGs; returns their paths."""
    runs = {_label(d): read_metrics(d) for d in run_dirs}
    empty = [d for d, rows in zip(run_dirs, runs.values()) if not rows]
    if empty:
        raise ValueError(f"RUN_DIR: no metrics.jsonl rows in {empty}")
    out_dir = out_dir or os.path.join(run_dirs[0], "plots")
    os.makedirs(out_dir, exist_ok=True)
    return [
        plot_loss(runs, out_dir),
        plot_layers(runs, out_dir, ("max_gain",), "max_gain.png", "max QK gain per layer"),
        plot_layers(
            runs, out_dir, ("top1_share", "top4_share"), "top_share.png", "top-channel share"
        ),
        plot_layers(runs, out_dir, ("residual_post",), "residual.png", "dS row-sum residual"),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument(
        "--out", default=None, help="output directory (default: RUN_DIR/plots of the first run)"
    )
    args = p.parse_args(argv)
    try:
        paths = plot_runs(args.run_dirs, args.out)
    except ValueError as e:
        p.error(str(e))
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
