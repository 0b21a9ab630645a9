"""Comparison presets: model size, batch shape and evaluation sizes per named preset.

A preset fixes everything but the attention arm, so every arm of a comparison trains the
same model from the same initialization on the same data order (same `seed`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from dm_jax.arms import ARM_NAMES as ARMS
from train.eval.suite import RulerConfig

DEFAULT_ARMS = ("reference", "stale", "do_matched", "matched", "cudnn_fp8")


@dataclasses.dataclass(frozen=True)
class ComparePreset:
    """One comparison's shared settings.

    model_preset: a `train` size preset (the family comes from `--family`).
    batch_size, seq_len, steps, learning_rate: training (steps: without a time budget).
    log_every, eval_every, probe_every: training-time metrics (gains every log step,
      validation CE every eval step, the arm's own dS row-sum residual every probe step).
    val_batches: validation batches for CE and the masking probe.
    probe_rows: sequences of one validation batch fed to the dS row-sum residual probe.
    ruler: the long-context suite.
    """

    model_preset: str
    batch_size: int
    seq_len: int
    steps: int
    learning_rate: Optional[float] = None  # None: the train preset's default
    log_every: int = 10
    eval_every: int = 50
    probe_every: int = 50  # training-time dS residual probe of the arm's own mode (0: off)
    val_batches: int = 8
    probe_rows: int = 2
    ruler: RulerConfig = RulerConfig()


PRESETS = {
    # CPU smoke test: a few steps of the tiny model, short contexts.
    "tiny": ComparePreset(
        "tiny",
        batch_size=2,
        seq_len=64,
        steps=4,
        log_every=1,
        eval_every=2,
        probe_every=0,
        val_batches=1,
        probe_rows=1,
        ruler=RulerConfig(
            context_lengths=(512,),
            tasks=("niah_single", "frequent_words"),
            examples=2,
            batch_size=2,
        ),
    ),
    # One GPU, minutes per arm.
    "small": ComparePreset(
        "small",
        batch_size=16,
        seq_len=2048,
        steps=500,
        log_every=10,
        eval_every=50,
        val_batches=16,
        probe_rows=2,
        ruler=RulerConfig(context_lengths=(2048, 4096), examples=8, batch_size=8),
    ),
}


def get_preset(name: str) -> ComparePreset:
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]


def unavailable_reason(
    arm: str, backend: Optional[str] = None, packing: str = "concat"
) -> Optional[str]:
    """Why `arm` cannot run on this machine with this data `packing` (None if it can).
    `backend` defaults to JAX's."""
    if arm not in ARMS:
        raise ValueError(f"--arms: unknown arm {arm!r}; arms: {ARMS}")
    backend = backend or jax.default_backend()
    if arm.startswith("cudnn") and backend != "gpu":
        return f"needs an NVIDIA GPU with cuDNN attention (JAX backend here: {backend})"
    if arm == "cudnn_fp8" and packing == "segments":
        return "cuDNN FP8 attention takes no segment ids; run the comparison with --packing concat"
    return None
