"""The memory estimate against what runs used: one row per finished run directory.

    PYTHONPATH=. python3 benchmarks/memory_calibration.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a `python -m train` run (ideally with --skip-memory-check, so the estimate
did not choose its layout). The run's saved config gives `train.memory.estimate` of the
step it trained (scan, remat and all), computed here from shapes alone; its summary.json
gives the device's peak (`peak_device_bytes`, recorded on a GPU). The ratio estimate / peak
is what a calibration of train/memory.py's constants on the GPU would fit; the table is
printed, and written as JSON beside it with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from train import config as config_lib
from train import memory
from train import model as model_lib


def row(run_dir: str) -> dict:
    cfg = config_lib.RunConfig.load(run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    need = memory.estimate(cfg, model_lib.default_hooks().build, gpu=True)
    model = cfg.model_config
    peak = summary.get("peak_device_bytes")
    return dict(
        run=os.path.basename(os.path.normpath(run_dir)),
        preset=cfg.model.name,
        tokens=f"{cfg.batch_size} x {cfg.seq_len}",
        scan=model.scans_layers,
        remat=model.remat,
        estimate_gb=need.total / 1e9,
        state_gb=need.state / 1e9,
        activations_gb=need.activations / 1e9,
        peak_gb=None if peak is None else peak / 1e9,
        ratio=None if not peak else need.total / peak,
        tokens_per_s=summary.get("tokens_per_s"),
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| run | preset | batch x T | scan | remat | estimate GB (state + activations) "
        "| peak GB | estimate / peak | tokens/s |",
        "|" + " --- |" * 9,
    ]
    for r in rows:
        peak = "n/a" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        speed = "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        lines.append(
            f"| {r['run']} | {r['preset']} | {r['tokens']} | {r['scan']} | {r['remat']} | "
            f"{r['estimate_gb']:.1f} ({r['state_gb']:.1f} + {r['activations_gb']:.1f}) | "
            f"{peak} | {ratio} | {speed} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", default=None, help="directory for memory_calibration.json")
    args = p.parse_args(argv)
    rows = []
    for run_dir in args.run_dirs:
        try:
            rows.append(row(run_dir))
        except (OSError, ValueError, KeyError) as e:  # an unfinished run: say so, go on
            print(f"{run_dir}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory_calibration.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
