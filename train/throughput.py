"""Model FLOP rate and MFU (model FLOPs utilisation) of a training run.

    model FLOP/s = 6 * N * tokens/s      N = parameters outside the input embedding
    MFU          = model FLOP/s / (devices * dense bf16 peak of one device)

6 N is the forward and backward matmul work per token of the weights (2 N forward, 4 N
backward); attention scores and the linear recurrences are not counted, so MFU is
comparable with other dense-model reports. The input embedding is a gather, not a matmul;
the LM head is counted. Peaks are the vendors' dense (not 2:4 sparse) bf16 tensor-core
numbers, in one table; on a device not listed (a CPU) MFU is left out.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

# Dense bf16 tensor-core peak of one device, FLOP/s, matched against `device_kind`.
DENSE_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


def dense_bf16_peak(device_kind: str) -> float | None:
    """The table's peak for a device kind ('NVIDIA H200' -> 989e12); None if not listed."""
    for name, peak in DENSE_BF16_PEAK.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def non_embedding_params(model: nnx.Module) -> int:
    """Parameters of `model` outside its `nnx.Embed` tables."""
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    embedded = sum(
        x.size
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Embed)
        for x in jax.tree.leaves(nnx.state(node, nnx.Param))
    )
    return total - embedded


def utilisation(n_params: int, tokens_per_s: float, devices=None) -> dict:
    """{"model_flops_per_s", "peak_flops_per_s" (None off the table), "mfu" (None likewise),
    "device_kind"} for `n_params` (non-embedding) at `tokens_per_s` over `devices`."""
    devices = devices if devices is not None else jax.devices()
    kind = devices[0].device_kind
    rate = 6.0 * n_params * tokens_per_s
    peak = dense_bf16_peak(kind)
    total_peak = None if peak is None else peak * len(devices)
    mfu = rate / total_peak if total_peak and math.isfinite(rate) else None
    return dict(model_flops_per_s=rate, peak_flops_per_s=total_peak, mfu=mfu, device_kind=kind)
