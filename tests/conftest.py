import os
import tempfile

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# Pallas' GPU interpreter (jax >= 0.11) runs each warpgroup of a Mosaic GPU kernel as a
# thread whose barrier waits hold one of XLA's CPU threads; XLA starts as many as there are
# cores, so on two cores a kernel whose warpgroups wait at once (segment ids, causal drains)
# never finishes. NPROC, read when XLA's CPU client starts (at the first computation, after
# this file), gives it more. Older jax versions have no GPU interpreter: left as they are.
if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11):
    from pallas_kernels.fp8_attention.mosaic_gpu.forward import (  # starts no client either
        INTERPRETER_THREADS,
        interpreter_threads,
    )

    os.environ["NPROC"] = str(max(INTERPRETER_THREADS, interpreter_threads()))

# Training runs use jax's persistent compilation cache; keep the suite's entries out of the
# user's cache directory (one fresh directory per test session, shared by its workers).
CACHE = os.environ.setdefault("DM_JAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="dm_jax_jax_cache_"))

# Reference checks compare f32 math; keep matmuls exact on every backend.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def compile_once():
    """Every test compiles through the persistent cache, whatever its size: the same program
    traced again (an eager scan, a kernel at a shape another test used, a step a benchmark
    script times) is loaded instead of compiled. A test that points the cache elsewhere or
    turns it off (training runs, their tests) gets it back for the next test."""
    if jax.config.jax_compilation_cache_dir != CACHE:
        jax_cache.reset_cache()  # jax opens its cache once per process: let it move
        jax.config.update("jax_compilation_cache_dir", CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
