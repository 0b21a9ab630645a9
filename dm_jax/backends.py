"""Attention backends behind :func:`dm_jax.attention`.

Every backend offers the same three calls on the public layout ([B, T, H, D]):
  * ``check_supported(q, k, v, config)``: raise NotImplementedError for what it cannot run;
  * ``forward(q, k, v, q_ids, kv_ids, *, config) -> (out [B, T, Hq, Dv], lse [B, Hq, T])``;
  * ``backward(q, k, v, out, lse, do, q_ids, kv_ids, *, config) -> reference.BackwardResult``
    (dq, dk, dv, delta and the dS row statistics used by the diagnostics).
"""
from __future__ import annotations

from dm_jax import reference

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
    def backward(q, k, v, out, lse, do, q_ids, kv_ids, *, config):
        bs = config.block_sizes
        return reference.flash_backward(
            q, k, v, out, lse, do, _segments(q_ids, kv_ids),
            causal=config.causal, sm_scale=config.sm_scale, precision=config.precision,
            delta=config.delta, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
        )


class _PallasBackend:
    """The Pallas-Triton kernels (``interpret=True`` runs them on any device)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def check_supported(self, q, k, v, config):
        raise NotImplementedError(
            "implementation='pallas'/'pallas_interpret' is not available yet: the Pallas "
            "kernels are not built; use implementation='reference'"
        )

    forward = backward = check_supported


BACKENDS = {
    "reference": ReferenceBackend(),
    "pallas": _PallasBackend(interpret=False),
    "pallas_interpret": _PallasBackend(interpret=True),
}


def get_backend(name):
    return BACKENDS[name]
