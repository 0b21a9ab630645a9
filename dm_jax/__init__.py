"""dm_jax: FP8 flash attention for JAX with Delta-Matching."""
from dm_jax.attention import AttentionConfig, attention, default_implementation

__all__ = ["attention", "AttentionConfig", "default_implementation"]
__version__ = "0.1.0"
