"""How the FP8 dots of the kernels accumulate on Hopper (private JAX API, version-guarded).

Pallas emits ``tt.dot`` without ``max_num_imprecise_acc``. For FP8 operands with an FP32
result Triton then refuses Hopper's FP8 tensor-core instruction (wgmma) and lowers the dot
to the Ampere-style ``mma.sync`` in fp16 after converting both operands (PTX census,
docs/benchmarks.md "What the kernels compile to"). Asking for ``max_num_imprecise_acc``
>= 32 gives FP8 wgmma. The modes (``TritonConfig.fp8_accumulation``, config.py):

* ``"precise"``: no request; fp16 ``mma.sync``, exact FP32 accumulation, slowest.
* ``"promote32"``: FP8 wgmma; Triton adds each k32 instruction's partial sum into the
  FP32 accumulator, so reduced-precision sums span 32 products.
* ``"fast"``: FP8 wgmma, never promoted inside one ``tt.dot``; the reduced-precision sum
  spans one tile's dot (the head dim or the key tile, <= 256 products). Our kernels add
  every tile's dot into FP32 state themselves, whatever the sequence length.

Kernels carry their mode in their name (``*_accfast``, ``*_accpromote32``);
:func:`install` hooks the Pallas-Triton lowering so that exactly those kernels are
lowered with their request, under any ``jax.jit``, and every other kernel is untouched.
Guarded: if the private module, function or keyword is missing (another JAX version),
nothing is patched, :func:`install` warns once and returns False, and the kernels run
the precise path. The mode is part of the name so a kernel never shares a compilation
cache entry with a kernel of another mode.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

NEVER_PROMOTE = 1 << 30
# mode -> max_num_imprecise_acc asked of Triton (None: nothing asked)
MODES = {"precise": None, "promote32": 32, "fast": NEVER_PROMOTE}
_SUFFIX = "_acc"


def suffix(mode: str) -> str:
    """Kernel-name suffix of a mode ("" for the precise path)."""
    return "" if MODES[mode] is None else _SUFFIX + mode


def mode_of(kernel_name: str) -> str:
    for mode in MODES:
        if suffix(mode) and kernel_name.endswith(suffix(mode)):
            return mode
    return "precise"


class _DotWithImpreciseAcc:
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
def _dots_accumulate(max_num_imprecise_acc: Optional[int]):
    """While active, Pallas-Triton dots are emitted with ``max_num_imprecise_acc``
    (None: left alone). Yields whether the request is in force."""
    lowering = _lowering_module() if max_num_imprecise_acc is not None else None
    if lowering is None:
        yield False
        return
    dialect = lowering.tt_dialect
    lowering.tt_dialect = _DotWithImpreciseAcc(dialect, max_num_imprecise_acc)
    try:
        yield True
    finally:
        lowering.tt_dialect = dialect


def _kernel_name(jaxpr) -> str:
    info = getattr(jaxpr, "debug_info", None)
    return getattr(info, "func_name", "") or ""


_warned = []


def install() -> bool:
    """Hook the lowering so kernels named by :func:`suffix` get their mode (idempotent).

    Returns False (and warns once) where this JAX version's private API does not allow it;
    those kernels are then lowered with the precise path."""
    lowering = _lowering_module()
    if lowering is None:
        if not _warned:
            _warned.append(True)
            warnings.warn(
                "FP8 wgmma accumulation is not available with this JAX version "
                "(private Pallas-Triton API changed); kernels use the precise path",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    original = lowering.lower_jaxpr_to_triton_module
    if getattr(original, "_dm_fp8_accumulation", False):
        return True

    def lower_jaxpr_to_triton_module(jaxpr, *args, **kwargs):
        with _dots_accumulate(MODES[mode_of(_kernel_name(jaxpr))]):
            return original(jaxpr, *args, **kwargs)

    lower_jaxpr_to_triton_module._dm_fp8_accumulation = True
    lowering.lower_jaxpr_to_triton_module = lower_jaxpr_to_triton_module
    return True
