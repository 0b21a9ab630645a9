"""dm_jax: FP8 flash attention for JAX with Delta-Matching."""

from dm_jax.attention_op import AttentionConfig, attention
from dm_jax.backends import default_implementation
from pallas_kernels.fp8_attention.tiles import NumericsTiles

__all__ = ["AttentionConfig", "NumericsTiles", "attention", "default_implementation"]
__version__ = "0.1.0"
