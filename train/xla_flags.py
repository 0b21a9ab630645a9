"""XLA flags that a training run sets before jax starts its backend.

XLA reads ``XLA_FLAGS`` once, when the first computation starts the backend, so the entry
points (``python -m train``, ``train.profile_step``) set these while parsing their flags,
before any array exists.

``--xla-gemm cublas`` (the default) runs XLA's matmuls through cuBLAS
(``--xla_gpu_enable_triton_gemm=false``). XLA's default, ``--xla-gemm triton``, fuses
matmuls into Triton kernels and autotunes each fusion's tiling while it compiles. On the
H200 the ``569m`` step compiled in 29 s (``cudnn_bf16``) and 41 s (``matched``) with
cuBLAS against 194 s and 270 s with Triton GEMMs, and trained as fast or faster (77,458
against 75,954 tokens/s; docs/training.md). Matmuls only: Pallas kernels are not affected.
A setting of the same flag already in ``XLA_FLAGS`` wins. Other backends ignore it.
"""

from __future__ import annotations

import os

from jax._src import xla_bridge

GEMMS = ("cublas", "triton")
DEFAULT_GEMM = "cublas"
_TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def flag_value(name: str, flags: str) -> str | None:
    """The value that ``flags`` (an XLA_FLAGS string) gives flag ``name``, or None."""
    for word in flags.split():
        key, _, value = word.lstrip("-").partition("=")
        if key == name:
            return value
    return None


def set_unless_given(name: str, value: str) -> None:
    """Appends ``--name=value`` to XLA_FLAGS unless XLA_FLAGS already sets ``name``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag_value(name, flags) is None:
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def gemm_in_flags(flags: str) -> str | None:
    """The GEMM choice that ``flags`` (an XLA_FLAGS value) makes, or None."""
    value = flag_value(_TRITON_GEMM, flags)
    if value is None:
        return None
    return "cublas" if value.lower() in ("false", "0") else "triton"


def use_gemm(choice: str) -> str:
    """Asks XLA for ``choice``'s matmuls (see the module docstring). Returns the choice in
    effect: the one already in XLA_FLAGS if any, else ``choice`` if jax's backend has not
    started yet, else XLA's default "triton" (too late: XLA has read its flags)."""
    if choice not in GEMMS:
        raise ValueError(f"--xla-gemm: expected one of {GEMMS}, got {choice!r}")
    given = gemm_in_flags(os.environ.get("XLA_FLAGS", ""))
    if given is not None:
        return given
    if xla_bridge.backends_are_initialized():
        return "triton"
    if choice == "cublas":
        set_unless_given(_TRITON_GEMM, "false")
    return choice
