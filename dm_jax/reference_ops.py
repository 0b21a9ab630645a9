"""The pure-JAX emulation (:mod:`dm_jax.reference`) as a backend: the same ops protocol as the
Pallas backends (:class:`pallas_kernels.fp8_attention.api.KernelOps`), so the registry, the
tests and the benchmarks treat it like any kernel backend. It runs on any device and takes
no launch settings; it honours every tile of ``spec.tiles`` (it is what defines them).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from dm_jax import reference
from pallas_kernels.fp8_attention.api import AttentionSpec, BackwardResult, ForwardResult, Pass


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """The emulation has no launch settings."""


Config = ReferenceConfig


def default_config(head_dim_qk: int, head_dim_v: int) -> ReferenceConfig:
    del head_dim_qk, head_dim_v
    return ReferenceConfig()


def supported(q_shape, k_shape, v_shape, dtype, spec, config) -> Optional[str]:
    del q_shape, k_shape, v_shape, dtype, spec, config  # every valid call runs
    return None


def _segments(q_ids, kv_ids):
    return None if q_ids is None else (q_ids, kv_ids)


def forward(q, k, v, q_ids=None, kv_ids=None, *, spec: AttentionSpec, config, interpret=False):
    """Blockwise forward on the forward tiles: out [B, T, Hq, Dv], lse [B, Hq, T]."""
    del config, interpret
    out, lse = reference.flash_forward(
        q,
        k,
        v,
        _segments(q_ids, kv_ids),
        causal=spec.causal,
        sm_scale=spec.sm_scale,
        precision=spec.precision,
        block_q=spec.tiles.block_q,
        block_k=spec.tiles.block_k,
    )
    return ForwardResult(out, lse)


def backward(
    q, k, v, out, lse, do, q_ids=None, kv_ids=None, *, spec: AttentionSpec, config,
    interpret=False, with_stats=False,
) -> BackwardResult:  # fmt: skip
    """Blockwise backward on the dS scale tiles; always returns the dS row statistics."""
    del config, interpret, with_stats
    return reference.flash_backward(
        q,
        k,
        v,
        out,
        lse,
        do,
        _segments(q_ids, kv_ids),
        causal=spec.causal,
        sm_scale=spec.sm_scale,
        precision=spec.precision,
        delta=spec.delta,
        block_q=spec.tiles.bwd_block_q,
        block_k=spec.tiles.bwd_block_k,
        ds_scale=spec.tiles.ds_scale,
    )


def delta(q, k, v, out, lse, do, q_ids=None, kv_ids=None, *, spec, config, interpret=False):
    """delta [B, Hq, T]: the one :func:`backward` uses (computed by running it)."""
    return backward(q, k, v, out, lse, do, q_ids, kv_ids, spec=spec, config=config).delta


def passes(q, k, v, do, *, spec: AttentionSpec, config, interpret=False) -> dict:
    """The emulation's two jitted functions, forward and backward."""
    out, lse = forward(q, k, v, spec=spec, config=config)

    def fwd(q, k, v):
        return forward(q, k, v, spec=spec, config=config)

    def bwd(q, k, v, out, lse, do):
        return backward(q, k, v, out, lse, do, spec=spec, config=config)

    return {"forward": Pass(fwd, (q, k, v), 2), "backward": Pass(bwd, (q, k, v, out, lse, do), 5)}
