"""The Triton IR that Pallas hands to XLA for each kernel, on any host.

``lower_for_cuda(fn, *args)`` lowers ``jax.jit(fn)`` for the CUDA platform (no GPU needed)
and returns {kernel name: TTIR text}. Used by tests (what the kernels ask Triton for) and by
benchmarks/kernel_ir.py (compiled further for Hopper). Private JAX API (the Pallas-Triton
lowering function), as in :mod:`.fp8_accumulation`.
"""

from __future__ import annotations

import jax


def lower_for_cuda(fn, *args) -> dict:
    """{pallas_call name: Triton IR text} of every Pallas-Triton kernel in ``jax.jit(fn)``."""
    from jax._src.pallas.triton import lowering

    modules = {}
    original = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *rest, **kwargs):
        result = original(jaxpr, *rest, **kwargs)
        modules[jaxpr.debug_info.func_name] = result.module.operation.get_asm()
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return modules
