"""Opt-in fast FP8 accumulation for the Triton lowering (private JAX API, off by default).

Pallas emits ``tt.dot`` without ``max_num_imprecise_acc``. For FP8 operands Triton then
refuses Hopper's FP8 tensor-core instruction (wgmma), which accumulates in reduced
precision, and lowers the dot to the Ampere-style ``mma.sync`` in fp16 after converting
both operands: every FP8 dot of our kernels runs as an fp16 dot (PTX census,
docs/benchmarks.md "What the kernels compile to"). Asking for ``max_num_imprecise_acc``
>= 32 gives wgmma on FP8 operands; raw Triton's default, used here, never promotes the
partial sums inside one ``tt.dot``. Our kernels add every tile's dot into FP32 state
themselves, so the reduced-precision sum spans one tile (at most the head dim or the key
tile, <= 256 products), whatever the sequence length.

Two ways to ask for it, both changing only kernels lowered while they apply:

* ``BlockSizes(fast_accumulation=True)``: the kernels get a ``_fastacc`` name and
  :func:`install` hooks the Pallas-Triton lowering so kernels with that name are lowered
  with the fast path, under any ``jax.jit``, while every other kernel is untouched.
* :func:`fast_fp8_accumulation`: every Pallas-Triton dot lowered inside the context.

Guarded: if the private module, function or keyword is missing (another JAX version),
nothing is patched, kernels keep the precise path, and :func:`install` returns False.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional

IMPRECISE_ACC = 1 << 30  # "never promote": the fast accumulation path
FAST_SUFFIX = "_fastacc"  # kernel-name suffix of kernels lowered with the fast path


class _DotWithFastAcc:
    def __init__(self, dialect, max_num_imprecise_acc):
        self._dialect = dialect
        self._imprecise = max_num_imprecise_acc

    def __getattr__(self, name):
        return getattr(self._dialect, name)

    def dot(self, a, b, c, **kwargs):
        kwargs.setdefault("max_num_imprecise_acc", self._imprecise)
        return self._dialect.dot(a, b, c, **kwargs)


def _lowering_module():
    """jax's Pallas-Triton lowering module, or None if its private API is not as expected."""
    try:
        from jax._src.pallas.triton import lowering
        lowering.tt_dialect.dot  # noqa: B018 (probe: the attribute must exist)
        lowering.lower_jaxpr_to_triton_module  # noqa: B018
    except (ImportError, AttributeError):
        return None
    return lowering


@contextlib.contextmanager
def fast_fp8_accumulation(enabled: bool = True, max_num_imprecise_acc: Optional[int] = None):
    """While active, Pallas-Triton dots are lowered with the fast FP8 accumulation path.

    ``max_num_imprecise_acc``: products accumulated in reduced precision before a
    promotion to FP32; None (``IMPRECISE_ACC``) never promotes within a dot, 32 promotes
    after every k32 wgmma instruction (still wgmma; Triton needs at least 32 for FP8
    wgmma). An enclosing context's value wins over an inner one's."""
    lowering = _lowering_module() if enabled else None
    if lowering is None or isinstance(lowering.tt_dialect, _DotWithFastAcc):
        yield lowering is not None
        return
    dialect = lowering.tt_dialect
    lowering.tt_dialect = _DotWithFastAcc(
        dialect, IMPRECISE_ACC if max_num_imprecise_acc is None else max_num_imprecise_acc)
    try:
        yield True
    finally:
        lowering.tt_dialect = dialect


def _kernel_name(jaxpr) -> str:
    info = getattr(jaxpr, "debug_info", None)
    return getattr(info, "func_name", "") or ""


def install() -> bool:
    """Hook the lowering so kernels named ``*_fastacc`` use the fast path (idempotent).

    Returns False (and warns once) where this JAX version's private API does not allow it;
    those kernels are then lowered with the precise path."""
    lowering = _lowering_module()
    if lowering is None:
        warnings.warn("fast FP8 accumulation is not available with this JAX version "
                      "(private Pallas-Triton API changed); kernels use the precise path",
                      RuntimeWarning, stacklevel=2)
        return False
    original = lowering.lower_jaxpr_to_triton_module
    if getattr(original, "_dm_fast_accumulation", False):
        return True

    def lower_jaxpr_to_triton_module(jaxpr, *args, **kwargs):
        with fast_fp8_accumulation(_kernel_name(jaxpr).endswith(FAST_SUFFIX)):
            return original(jaxpr, *args, **kwargs)

    lower_jaxpr_to_triton_module._dm_fast_accumulation = True
    lowering.lower_jaxpr_to_triton_module = lower_jaxpr_to_triton_module
    return True
