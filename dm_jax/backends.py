"""Attention backends behind :func:`dm_jax.attention`.

Every backend offers the same three calls on the public layout ([B, T, H, D]):
  * ``check_supported(q, k, v, config)``: raise NotImplementedError for what it cannot run;
  * ``forward(q, k, v, q_ids, kv_ids, *, config) -> (out [B, T, Hq, Dv], lse [B, Hq, T])``;
  * ``backward(q, k, v, out, lse, do, q_ids, kv_ids, *, config, with_stats=True)
    -> reference.BackwardResult``
    (dq, dk, dv, delta and the dS row statistics used by the diagnostics; with
    ``with_stats=False`` a backend may leave the statistics as None).
"""
from __future__ import annotations

from dm_jax import reference
from pallas_kernels.fp8_attention.triton import ops as fp8_ops

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "reference")


def _segments(q_ids, kv_ids):
    return None if q_ids is None else (q_ids, kv_ids)


class ReferenceBackend:
    """The pure-JAX blockwise emulation (:mod:`dm_jax.reference`): runs anywhere."""

    @staticmethod
    def check_supported(q, k, v, config):
        del q, k, v, config

    @staticmethod
    def forward(q, k, v, q_ids, kv_ids, *, config):
        bs = config.block_sizes
        return reference.flash_forward(
            q, k, v, _segments(q_ids, kv_ids),
            causal=config.causal, sm_scale=config.sm_scale, precision=config.precision,
            block_q=bs.block_q, block_k=bs.block_k,
        )

    @staticmethod
    def backward(q, k, v, out, lse, do, q_ids, kv_ids, *, config, with_stats=True):
        del with_stats  # the emulation always returns the dS row statistics
        bs = config.block_sizes
        return reference.flash_backward(
            q, k, v, out, lse, do, _segments(q_ids, kv_ids),
            causal=config.causal, sm_scale=config.sm_scale, precision=config.precision,
            delta=config.delta, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
        )


class PallasBackend:
    """The Pallas-Triton kernels (:mod:`pallas_kernels.fp8_attention`).

    ``interpret=True`` runs the same kernels in Pallas interpret mode on any device.
    ``backward(..., with_stats=False)`` skips the dS row statistics (training); the
    diagnostics call it with the default ``with_stats=True``.
    """

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def check_supported(self, q, k, v, config):
        reason = fp8_ops.unsupported_reason(q.shape, k.shape, v.shape, q.dtype, config.block_sizes)
        if reason is not None:
            raise NotImplementedError(f"implementation={config.implementation!r}: {reason}")

    def forward(self, q, k, v, q_ids, kv_ids, *, config):
        return fp8_ops.forward(
            q, k, v, q_ids, kv_ids, causal=config.causal, sm_scale=config.sm_scale,
            precision=config.precision, block_sizes=config.block_sizes,
            interpret=self.interpret,
        )

    def backward(self, q, k, v, out, lse, do, q_ids, kv_ids, *, config, with_stats=True):
        g = fp8_ops.backward(
            q, k, v, out, lse, do, q_ids, kv_ids, causal=config.causal,
            sm_scale=config.sm_scale, precision=config.precision, delta=config.delta,
            block_sizes=config.block_sizes, interpret=self.interpret, with_stats=with_stats,
        )
        stats = g.stats if with_stats else (None,) * 4
        return reference.BackwardResult(g.dq, g.dk, g.dv, g.delta, *stats)


BACKENDS = {
    "reference": ReferenceBackend(),
    "pallas": PallasBackend(interpret=False),
    "pallas_interpret": PallasBackend(interpret=True),
}


def get_backend(name):
    return BACKENDS[name]
