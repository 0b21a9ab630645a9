"""Opt-in fast FP8 accumulation for the Triton lowering (private JAX API, off by default).

Pallas emits ``tt.dot`` without ``max_num_imprecise_acc``, so Triton keeps the precise FP8
accumulation path (partial sums promoted to FP32 after every MMA). Raw Triton defaults to
the fast path (Hopper's FP8 MMA accumulator, roughly 14 mantissa bits). This context
manager patches the lowering module's view of the Triton dialect so every dot it emits
while active asks for the fast path. It only matters while a kernel is being *lowered*
(the first call of a jitted function), and kernels lowered with it must not share a cache
entry with precise ones (``BlockSizes.fast_accumulation`` renames them).

Guarded: if the private module or the keyword is missing (another JAX version), it does
nothing and yields False. Use only where measured accurate (docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib

IMPRECISE_ACC = 1 << 30  # "never promote": the fast accumulation path


class _DotWithFastAcc:
    def __init__(self, dialect):
        self._dialect = dialect

    def __getattr__(self, name):
        return getattr(self._dialect, name)

    def dot(self, a, b, c, **kwargs):
        kwargs.setdefault("max_num_imprecise_acc", IMPRECISE_ACC)
        return self._dialect.dot(a, b, c, **kwargs)


@contextlib.contextmanager
def fast_fp8_accumulation(enabled: bool = True):
    """While active, Pallas-Triton dots are lowered with the fast FP8 accumulation path."""
    if not enabled:
        yield False
        return
    try:
        from jax._src.pallas.triton import lowering
        dialect = lowering.tt_dialect
        dialect.dot  # noqa: B018 (probe: the attribute must exist)
    except (ImportError, AttributeError):
        yield False
        return
    lowering.tt_dialect = _DotWithFastAcc(dialect)
    try:
        yield True
    finally:
        lowering.tt_dialect = dialect
