import jax

# Reference checks compare f32 math; keep matmuls exact on every backend.
jax.config.update("jax_default_matmul_precision", "highest")
