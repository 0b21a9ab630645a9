"""Hybrid language models and their named presets."""

from dm_jax.models.config import HybridConfig, LAYER_KINDS
from dm_jax.models.hybrid import HybridLM, attention_probe, qk_gains
from dm_jax.models.presets import FAMILIES, SIZES, preset

__all__ = [
    "FAMILIES",
    "HybridConfig",
    "HybridLM",
    "LAYER_KINDS",
    "SIZES",
    "attention_probe",
    "preset",
    "qk_gains",
]
