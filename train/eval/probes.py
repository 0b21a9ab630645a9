"""Model probes: validation cross-entropy, attention masking, dS row-sum residuals.

They take callables, not training internals:
  logits_fn(tokens_BT, *, segment_ids=None, ablate_attention_layers=()) -> logits [B, T, V]
  probe_fn(tokens_BT, targets_BT) -> {layer: dict(q=[B,T,Hq,D], k=[B,S,Hkv,D], v=..., do=...)}
Batches are dicts with `tokens`, `targets` (int32 [B, T]) and optionally `segments`
(int32 [B, T] document ids, or None) and `mask` (float32 [B, T], 1 where the target
counts), as `train.data.Batches` serves them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from dm_jax.numerics import DELTA_MODES


def _token_nll(logits_BTV, targets_BT) -> np.ndarray:
    """Negative log-likelihood per token [B, T] (float64, computed on the host)."""
    logits = np.asarray(logits_BTV, np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits).sum(-1))
    return logz - np.take_along_axis(logits, np.asarray(targets_BT)[..., None], -1)[..., 0]


def cross_entropy(logits_fn: Callable, batches: Iterable[Mapping], **kwargs) -> float:
    """Mean token cross-entropy (nats) of `logits_fn` over `batches` (mask-weighted).

    `kwargs` go to `logits_fn` (e.g. `ablate_attention_layers=(5,)`).
    """
    total, count = 0.0, 0.0
    for batch in batches:
        logits_BTV = logits_fn(
            np.asarray(batch["tokens"]), segment_ids=batch.get("segments"), **kwargs
        )
        nll_BT = _token_nll(logits_BTV, batch["targets"])
        mask_BT = np.asarray(batch.get("mask", np.ones(nll_BT.shape)), np.float64)
        total += float((nll_BT * mask_BT).sum())
        count += float(mask_BT.sum())
    if count == 0:
        raise ValueError("batches: no target tokens to score")
    return total / count


@dataclasses.dataclass(frozen=True)
class MaskingResult:
    """Validation CE with and without one attention layer's output zeroed."""

    layer: int
    ce: float
    ce_masked: float

    @property
    def increase(self) -> float:
        return self.ce_masked - self.ce


def masking_probe(logits_fn: Callable, batches: Sequence[Mapping], layer: int) -> MaskingResult:
    """Zero attention layer `layer`'s output and report the cross-entropy increase.

    A layer the model relies on costs a lot when masked; a small increase in a model whose
    attention went bad suggests the rest of the network has learned to route around it.
    """
    batches = list(batches)
    return MaskingResult(
        layer,
        cross_entropy(logits_fn, batches),
        cross_entropy(logits_fn, batches, ablate_attention_layers=(layer,)),
    )


@dataclasses.dataclass(frozen=True)
class ResidualStats:
    """Mean normalized dS row-sum residual |sum_j dS_ij| / sum_j |dS_ij| of one layer and mode."""

    layer: int
    delta: str
    pre_cast: float
    post_cast: float


def residual_probe(
    probe_fn: Callable,
    row_sum_fn: Callable,
    batch: Mapping,
    *,
    deltas: Sequence[str] = DELTA_MODES,
    causal: bool = True,
) -> list[ResidualStats]:
    """dS row-sum residuals on a trained model's real attention inputs, per layer and delta mode.

    probe_fn: (tokens_BT, targets_BT) -> {layer: dict(q, k, v, do)} captured from a forward and
      backward pass (e.g. `dm_jax.models.attention_probe` bound to a model).
    row_sum_fn: `dm_jax.diagnostics.row_sum_residuals`-like: (q, k, v, do, causal=, delta=,
      segment_ids=) -> dict(pre_cast=[B,H,T], post_cast=[B,H,T]).
    The batch's `segments` (if any) are passed as segment ids.
    """
    captured = probe_fn(np.asarray(batch["tokens"]), np.asarray(batch["targets"]))
    segments = batch.get("segments")
    out = []
    for layer in sorted(captured):
        x = captured[layer]
        for delta in deltas:
            r = row_sum_fn(
                x["q"],
                x["k"],
                x["v"],
                x["do"],
                causal=causal,
                delta=delta,
                segment_ids=None if segments is None else np.asarray(segments),
            )
            out.append(
                ResidualStats(
                    layer,
                    delta,
                    float(np.nanmean(np.asarray(r["pre_cast"]))),
                    float(np.nanmean(np.asarray(r["post_cast"]))),
                )
            )
    return out


def residual_ratio(
    stats: Sequence[ResidualStats],
    *,
    stage: str = "post_cast",
    numerator: str = "stale",
    denominator: str = "matched",
) -> dict[int, float]:
    """Per layer: mean residual of `numerator` mode / `denominator` mode at `stage`."""
    table = {(s.layer, s.delta): getattr(s, stage) for s in stats}
    layers = sorted({s.layer for s in stats})
    return {
        l: table[(l, numerator)] / table[(l, denominator)]
        for l in layers
        if (l, numerator) in table and (l, denominator) in table
    }
