"""Statistics of a gradient bias measured over batches, and its plot.

The inputs are per-batch gradients of one parameter group (e.g. the query RMSNorm gains of
one layer): ``arm_NC`` under an FP8 attention arm and ``ref_NC`` under the f32 reference,
on the same weights and the same N batches, C channels each. The bias of the arm is the
per-batch difference ``d_NC = arm_NC - ref_NC``; everything here is a function of d and ref.

Adam turns a consistent bias into drift: with update m / sqrt(v), a bias b_c on a channel
whose gradient has root-mean-square rms_c moves the parameter by about lr * b_c / rms_c per
step more than the reference would (`adam_step_bias`, in units of the learning rate).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np


def _norm(x) -> float:
    return float(np.sqrt(np.sum(np.square(x))))


def _t_statistic(bias, se):
    """bias / se; 0 where both are 0, +-inf where only se is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, bias / np.where(se > 0, se, 1.0), np.sign(bias) * np.inf)
    return np.where((se == 0) & (bias == 0), 0.0, t)


def channel_bias(arm_NC, ref_NC) -> dict:
    """Per channel: mean bias, its standard error over batches, and t = bias / se.

    Args:
      arm_NC, ref_NC: [N, C] gradients of one parameter group, N >= 2 batches.
    Returns:
      dict of [C] float64 arrays: ``bias`` (mean of arm - ref), ``se`` (its standard
      error, ddof 1), ``t`` (bias / se; 0 where both are 0, +-inf where only se is 0),
      ``sign_agreement`` (share of batches whose difference has the sign of the mean of the
      other batches: 0.5 for a symmetric noise without bias, whatever N; NaN where every
      difference is 0),
      ``ref_mean``, ``ref_sd`` (batch-to-batch standard deviation of the reference gradient)
      and ``ref_rms``.
    """
    arm_NC, ref_NC = np.asarray(arm_NC, np.float64), np.asarray(ref_NC, np.float64)
    if arm_NC.ndim != 2 or arm_NC.shape != ref_NC.shape:
        raise ValueError(
            f"arm_NC, ref_NC: expected two [N, C] arrays of one shape, got "
            f"{arm_NC.shape}, {ref_NC.shape}"
        )
    n = arm_NC.shape[0]
    if n < 2:
        raise ValueError(f"arm_NC: need >= 2 batches for a standard error, got {n}")
    d_NC = arm_NC - ref_NC
    bias = d_NC.mean(0)
    se = d_NC.std(0, ddof=1) / math.sqrt(n)
    t = _t_statistic(bias, se)
    others_NC = (d_NC.sum(0)[None] - d_NC) / (n - 1)  # mean of the other batches
    agreement = (np.sign(d_NC) == np.sign(others_NC)).mean(0)
    agreement = np.where(np.any(d_NC != 0, 0), agreement, np.nan)  # no bias at all: undefined
    return dict(
        bias=bias,
        se=se,
        t=t,
        sign_agreement=agreement,
        ref_mean=ref_NC.mean(0),
        ref_sd=ref_NC.std(0, ddof=1),
        ref_rms=np.sqrt(np.mean(np.square(ref_NC), 0)),
    )


class Moments:
    """Running sums of d = arm - ref and of ref over batches, for parameter groups too large
    to keep every batch (the attention projections): `channels()` gives `channel_bias`'s
    output without ``sign_agreement``."""

    def __init__(self):
        self.n, self._sums = 0, None

    def add(self, arm_C, ref_C) -> None:
        arm_C, ref_C = np.ravel(arm_C).astype(np.float64), np.ravel(ref_C).astype(np.float64)
        d_C = arm_C - ref_C
        terms = (d_C, d_C * d_C, ref_C, ref_C * ref_C)
        self._sums = (
            list(terms) if self._sums is None else [a + b for a, b in zip(self._sums, terms)]
        )
        self.n += 1

    def channels(self) -> dict:
        if self.n < 2:
            raise ValueError(f"Moments: need >= 2 batches for a standard error, got {self.n}")
        n = self.n
        sum_d, sum_d2, sum_r, sum_r2 = self._sums
        bias, ref_mean = sum_d / n, sum_r / n
        var_d = np.maximum(sum_d2 - n * bias**2, 0.0) / (n - 1)
        var_r = np.maximum(sum_r2 - n * ref_mean**2, 0.0) / (n - 1)
        se = np.sqrt(var_d / n)
        t = _t_statistic(bias, se)
        return dict(
            bias=bias,
            se=se,
            t=t,
            ref_mean=ref_mean,
            ref_sd=np.sqrt(var_r),
            ref_rms=np.sqrt(sum_r2 / n),
        )


def correlation(x, y) -> Optional[float]:
    """Pearson correlation of two [C] vectors; None when either is constant (e.g. gains at
    their initial value 1, where no channel is larger than another)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def _nanmean(x) -> Optional[float]:
    if x is None or not np.any(np.isfinite(x)):
        return None
    return float(np.nanmean(x))


def summarize(channels: dict, product=None) -> dict:
    """One group's numbers from `channel_bias` output (groups can be concatenated first).

    product: [C] g_q * g_k of the channels (gains only): adds ``corr_push_product``, the
    correlation of the push the bias gives the gain (-bias: gradient descent moves a gain
    up where its bias is negative) with the channel's gain product, and
    ``corr_abs_bias_product`` (|bias| vs |product|).
    Returns JSON-ready floats: ``channels``, ``bias_norm``, ``noise_norm`` (norm over
    channels of the reference's batch-to-batch sd), ``bias_to_noise``, ``ref_mean_norm``,
    ``share_abs_t_gt_3``, ``sign_agreement`` (mean over channels with any difference; 0.5 =
    no consistency; None from `Moments` or without any difference),
    ``upward_share`` (among |t| > 3 channels: share pushed up, None if there are none),
    ``adam_step_bias_mean`` / ``_max`` (|bias| / rms of the reference gradient, mean and max
    over channels: extra Adam step per update in units of the learning rate).
    """
    bias, t = channels["bias"], channels["t"]
    significant = np.abs(t) > 3
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(channels["ref_rms"] > 0, np.abs(bias) / channels["ref_rms"], 0.0)
    noise = _norm(channels["ref_sd"])
    out = dict(
        channels=int(bias.size),
        bias_norm=_norm(bias),
        noise_norm=noise,
        bias_to_noise=_norm(bias) / noise if noise > 0 else None,
        ref_mean_norm=_norm(channels["ref_mean"]),
        share_abs_t_gt_3=float(significant.mean()),
        sign_agreement=_nanmean(channels.get("sign_agreement")),
        upward_share=float((bias[significant] < 0).mean()) if significant.any() else None,
        adam_step_bias_mean=float(step.mean()),
        adam_step_bias_max=float(step.max()),
    )
    if product is not None:
        out["corr_push_product"] = correlation(-bias, product)
        out["corr_abs_bias_product"] = correlation(np.abs(bias), np.abs(product))
    return out


def concat(groups) -> dict:
    """`channel_bias` outputs of several groups joined along the channel axis."""
    groups = list(groups)
    return {k: np.concatenate([g[k] for g in groups]) for k in groups[0]}


def plot_gain_bias(arm: str, layers: dict, out_dir: str, products: Optional[dict] = None) -> str:
    """Bias per channel with +-1 standard error bars, one row per attention layer, query and
    key gains side by side; channels with |t| > 3 in red. Returns the PNG path.

    layers: {layer name: {"q": channel_bias dict, "k": channel_bias dict}};
    products: {layer name: [C] g_q * g_k}, drawn on a second axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(layers)
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        for ax, which in zip(row, ("q", "k")):
            ch = layers[name][which]
            x = np.arange(ch["bias"].size)
            sig = np.abs(ch["t"]) > 3
            ax.errorbar(x, ch["bias"], yerr=ch["se"], fmt="none", ecolor="0.6", lw=0.8)
            ax.scatter(x[~sig], ch["bias"][~sig], s=6, color="tab:blue", label="|t| <= 3")
            ax.scatter(x[sig], ch["bias"][sig], s=8, color="tab:red", label="|t| > 3")
            ax.axhline(0, color="k", lw=0.5)
            ax.set(
                title=f"{arm} - reference: d loss / d g_{which}, {name}",
                xlabel="channel",
                ylabel="mean gradient bias",
            )
            if products is not None and name in products:
                twin = ax.twinx()
                twin.plot(x, products[name], color="tab:green", lw=0.7, alpha=0.6)
                twin.set_ylabel("g_q * g_k", color="tab:green")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = os.path.join(out_dir, f"gain_bias_{arm}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
