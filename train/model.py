"""The model side of training: how a RunConfig becomes an nnx model, and its diagnostics.

`ModelHooks` bundles the three things the trainer needs from a model library; the default
uses dm_jax.models (HybridLM, qk_gains, attention_probe) and dm_jax.diagnostics. Anything
with the same call signatures can stand in (tests use a tiny model).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """build(run_config) -> nnx.Module with `model(tokens_BT, *, segment_ids=None) -> logits_BTV`;
    qk_gains(model) -> {layer: (g_q, g_k)}; attention_probe(model, tokens_BT, targets_BT, *,
    segment_ids) -> {layer: dict(q=, k=, v=, do=)}; gain_statistics / row_sum_residuals as in
    dm_jax.diagnostics. The last four may be None (their metrics are then skipped)."""

    build: Callable
    qk_gains: Optional[Callable] = None
    attention_probe: Optional[Callable] = None
    gain_statistics: Optional[Callable] = None
    row_sum_residuals: Optional[Callable] = None


def build_hybrid(run_config) -> nnx.Module:
    """dm_jax.models.HybridLM for `run_config.model_config`, initialized from `run_config.seed`.

    The initialization depends only on the seed and the model config minus the attention arm,
    so runs that differ only in `--attention` start from identical weights."""
    from dm_jax import models

    return models.HybridLM(run_config.model_config, rngs=nnx.Rngs(run_config.seed))


def default_hooks() -> ModelHooks:
    from dm_jax import diagnostics, models

    return ModelHooks(
        build=build_hybrid,
        qk_gains=getattr(models, "qk_gains", None),
        attention_probe=getattr(models, "attention_probe", None),
        gain_statistics=getattr(diagnostics, "gain_statistics", None),
        row_sum_residuals=getattr(diagnostics, "row_sum_residuals", None),
    )
