"""What every backend of the FP8 attention op offers: call settings, results, the protocol.

A backend is one ops module (``triton/ops.py``, ``mosaic_gpu/ops.py``; the pure-JAX
emulation has ``dm_jax/reference_ops.py``) with the members of :class:`KernelOps`. The
library (``dm_jax.backends``) registers each module under a name and wraps ``forward`` and
``backward`` in one ``jax.custom_vjp``; no autodiff happens in a backend.

Layouts: the public one everywhere, q [B, T, Hq, Dqk], k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv]
with Hq % Hkv == 0; segment ids q_ids [B, T], kv_ids [B, S] int32 or both None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol

import jax

from pallas_kernels.fp8_attention.tiles import NumericsTiles


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The numbers one call computes (hashable: a static argument under jit).

    causal: keys after the query position are masked (top-left aligned).
    delta: one of ``numerics.DELTA_MODES``; precision: one of ``numerics.PRECISIONS``.
    sm_scale: the softmax scale. tiles: the tiles every backend honours (:mod:`.tiles`).
    """

    causal: bool
    delta: str
    precision: str
    sm_scale: float
    tiles: NumericsTiles


class ForwardResult(NamedTuple):
    out: jax.Array  # [B, T, Hq, Dv] in q's dtype
    lse: jax.Array  # [B, Hq, T] f32 log-sum-exp of the scaled logits (+inf: no visible key)


class BackwardResult(NamedTuple):
    """Gradients, the delta the backward used, and the dS row statistics of the diagnostics
    (sum_j dS_ij and sum_j |dS_ij| before and after the cast of dS; None unless asked for)."""

    dq: jax.Array  # [B, T, Hq, Dqk]
    dk: jax.Array  # [B, S, Hkv, Dqk]
    dv: jax.Array  # [B, S, Hkv, Dv]
    delta: jax.Array  # [B, Hq, T] f32
    ds_rowsum_pre: Optional[jax.Array] = None  # [B, Hq, T] f32
    ds_abssum_pre: Optional[jax.Array] = None
    ds_rowsum_post: Optional[jax.Array] = None
    ds_abssum_post: Optional[jax.Array] = None


class Pass(NamedTuple):
    """One separately timed piece of a backend (benchmarks/passes.py): ``fn(*args)``."""

    fn: Callable
    args: tuple
    matmuls: int  # attention-sized matmuls it runs (2 B H T S D FLOPs each), 0 if none


class KernelOps(Protocol):
    """The members of a backend's ops module (module-level names).

    ``Config`` is the backend's frozen launch-settings dataclass; ``config`` arguments are
    instances of it. ``interpret`` runs the kernels in Pallas interpret mode (any host).
    """

    Config: type

    def default_config(self, head_dim_qk: int, head_dim_v: int) -> Any:
        """The tuned launch settings for these head dims."""

    def supported(
        self, q_shape, k_shape, v_shape, dtype, spec: AttentionSpec, config
    ) -> Optional[str]:
        """None if the backend runs this call, else one sentence saying what it supports."""

    def forward(
        self, q, k, v, q_ids, kv_ids, *, spec: AttentionSpec, config, interpret: bool
    ) -> ForwardResult:
        """Flash forward: output and log-sum-exp."""

    def delta(
        self, q, k, v, out, lse, do, q_ids, kv_ids, *, spec: AttentionSpec, config, interpret: bool
    ) -> jax.Array:
        """delta_i [B, Hq, T] f32 of ``spec.delta``, exactly as :func:`backward` forms it."""

    def backward(
        self,
        q,
        k,
        v,
        out,
        lse,
        do,
        q_ids,
        kv_ids,
        *,
        spec: AttentionSpec,
        config,
        interpret: bool,
        with_stats: bool = False,
    ) -> BackwardResult:
        """Flash backward with recomputed P; the dS row statistics only ``with_stats``."""

    def passes(self, q, k, v, do, *, spec: AttentionSpec, config, interpret: bool) -> dict:
        """{name: :class:`Pass`} of the backend's pieces, for benchmarks/passes.py."""


OPS_MEMBERS = ("Config", "default_config", "supported", "forward", "delta", "backward", "passes")


def missing_members(ops) -> list:
    """The members of :class:`KernelOps` that the module ``ops`` lacks."""
    return [name for name in OPS_MEMBERS if not hasattr(ops, name)]
