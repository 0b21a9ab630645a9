import os
import tempfile

import jax

# Training runs use jax's persistent compilation cache; keep the suite's entries out of the
# user's cache directory (one fresh directory per test process).
os.environ.setdefault("DM_JAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="dm_jax_jax_cache_"))

# Reference checks compare f32 math; keep matmuls exact on every backend.
jax.config.update("jax_default_matmul_precision", "highest")
