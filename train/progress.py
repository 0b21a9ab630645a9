"""Terminal output: a rich progress bar during training and a summary at the end."""

from __future__ import annotations

import jax
from rich.console import Console as RichConsole
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from dm_jax.backends import default_implementation


def _count_params(model) -> int:
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


class Console:
    """Progress bar + summary; silent (except errors) when `enabled` is False."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and jax.process_index() == 0
        self.console = RichConsole(stderr=False)
        self._progress = None
        self._task = None

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{text}[/dim]")

    def start(self, cfg, splits, *, hooks_model, first_step: int, last_step: int) -> None:
        if not self.enabled:
            return
        impl = dict(cfg.model.overrides).get("attention_implementation") or default_implementation()
        self.console.print(
            f"[bold]{cfg.model.name}[/bold] ({_count_params(hooks_model) / 1e6:.2f}M params), "
            f"attention [bold]{cfg.attention}[/bold] ({impl}), {cfg.optimizer.name}, "
            f"batch {cfg.batch_size} x {cfg.seq_len}, {jax.device_count()} {jax.default_backend()} device(s)"
        )
        self.console.print(f"data: {splits.description}")
        self.console.print(f"run dir: {cfg.run_dir}")
        self._progress = Progress(
            TextColumn("[bold blue]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=last_step, completed=first_step, info="compiling..."
        )

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def update(self, step: int, row: dict) -> None:
        if self._progress is None:
            return
        info = f"loss {row['loss']:.3f}"
        if "val_ce" in row:
            info += f"  val {row['val_ce']:.3f}"
        if "tokens_per_s" in row:
            info += f"  {row['tokens_per_s']:,.0f} tok/s"
        self._progress.update(self._task, completed=step, info=info)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, result, cfg) -> None:
        if not self.enabled:
            return
        table = Table(
            title=f"run {result.status} at step {result.step}/{cfg.steps}", show_header=False
        )
        m = result.metrics
        for key, label, fmt in (
            ("loss", "train loss", "{:.4f}"),
            ("val_ce", "validation CE", "{:.4f}"),
            ("grad_norm", "grad norm", "{:.3f}"),
        ):
            if isinstance(m.get(key), (int, float)):
                table.add_row(label, fmt.format(m[key]))
        table.add_row("tokens/s", f"{result.tokens_per_s:,.0f} (mean, after compilation)")
        table.add_row("compile", f"{result.compile_seconds:.1f} s, {result.compile_cache}")
        util = result.utilisation
        if util:
            table.add_row("model FLOP/s", f"{util['model_flops_per_s'] / 1e12:.2f} TFLOP/s (6 N)")
            table.add_row(
                "MFU",
                f"{util['mfu']:.1%} of {util['peak_flops_per_s'] / 1e12:.0f} TFLOP/s dense bf16"
                if util["mfu"] is not None
                else f"n/a (no dense bf16 peak listed for {util['device_kind']!r})",
            )
        gains = [v for k, v in m.items() if k.endswith("/max_gain")]
        if gains:
            table.add_row("max QK gain", f"{max(gains):.3f}")
        table.add_row("checkpoint", f"step {result.checkpoint_step}")
        table.add_row("run dir", result.run_dir)
        self.console.print(table)
        self.console.print(f"plots:  python -m train.plot {result.run_dir}")
        if result.status != "done":
            self.console.print(f"continue: python -m train --resume --run-dir {result.run_dir}")
