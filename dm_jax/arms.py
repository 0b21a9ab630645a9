"""The attention arms of the experiments: one table that the layers, the model config, the
trainer, the comparisons and the tests all read.

An arm is a way to run the softmax-attention core of a model (the `attention=` switch of
`dm_jax.models.HybridConfig`, `--attention` of `python -m train`):

  reference    high-precision XLA attention (`dm_jax.reference.mha_reference`, FP32 math):
               the paper's BF16/FP32 reference
  bf16         our flash path with bf16 operands (`dm_jax.attention(precision="bf16")`), with
               the conventional delta = rowsum(dO * O) of every flash kernel
  matched      `dm_jax.attention(delta="matched")`: Delta-Matching, delta_i = sum_j P_ij dP^_ij
  do_matched   `dm_jax.attention(delta="do_matched")`: delta_i = <dO^_i, O_i>
  stale        `dm_jax.attention(delta="stale")`: delta_i = <dO_i, O_i> (FP8 operands elsewhere)
  cudnn_fp8    cuDNN's FP8 flash attention with current per-tensor scales (`dm_jax.baselines`)
  cudnn_bf16   cuDNN's bf16 flash attention (`dm_jax.baselines`)

`dm_jax.nn.attention_core` runs an arm; this module only describes them (no jax import
beyond the FP8 vocabulary), so configuration code can validate names cheaply.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.fp8_attention.numerics import DELTA_MODES, PRECISIONS

CORES = ("xla", "dm_jax", "cudnn")  # which function runs an arm (dm_jax.nn.attention_core)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One attention arm.

    core: which function runs it: "xla" (f32 attention), "dm_jax" (`dm_jax.attention`) or
      "cudnn" (`dm_jax.baselines`, the function of the core precision).
    precisions: the core precisions it runs at ("f32" or `numerics.PRECISIONS`); the first
      is its default (the `attn_core` scope of a model may pick another).
    delta: the delta mode it asks `dm_jax.attention` for (dm_jax arms only).
    fp8: an FP8 arm: attention projections are FP8 unless the model says otherwise, and the
      residual probe measures its own delta mode.
    """

    name: str
    core: str
    precisions: tuple
    delta: Optional[str] = None
    fp8: bool = False

    def __post_init__(self):
        if self.core not in CORES or (self.delta in DELTA_MODES) != (self.core == "dm_jax"):
            raise ValueError(f"arm {self.name!r}: core {self.core!r} with delta {self.delta!r}")
        if not set(self.precisions) <= set(PRECISIONS) | {"f32"}:
            raise ValueError(f"arm {self.name!r}: precisions {self.precisions}")

    @property
    def probe_delta(self) -> str:
        """The delta mode whose dS row sums the residual probe reads for this arm (its own
        for the dm_jax arms, the conventional stale delta for the others)."""
        return self.delta or "stale"


ARMS = {
    arm.name: arm
    for arm in (
        Arm("reference", "xla", ("f32",)),
        Arm("bf16", "dm_jax", ("bf16",), delta="stale"),
        *(Arm(mode, "dm_jax", ("fp8", "bf16"), delta=mode, fp8=True) for mode in DELTA_MODES),
        Arm("cudnn_fp8", "cudnn", ("fp8",), fp8=True),
        Arm("cudnn_bf16", "cudnn", ("bf16",)),
    )
}
ARM_NAMES = tuple(ARMS)
DELTA_ARMS = tuple(name for name, arm in ARMS.items() if arm.core == "dm_jax" and arm.fp8)
FP8_ARMS = tuple(name for name, arm in ARMS.items() if arm.fp8)


def check_arm(name: str, precision: Optional[str] = None) -> str:
    """Validates (arm, core precision); returns the precision the core runs at."""
    if name not in ARMS:
        raise ValueError(f"attention: must be one of {ARM_NAMES}, got {name!r}")
    arm = ARMS[name]
    precision = precision or arm.precisions[0]
    if precision not in arm.precisions:
        raise ValueError(f"attn_core: arm {name!r} runs at {arm.precisions}, got {precision!r}")
    return precision
