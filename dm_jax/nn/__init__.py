"""Flax NNX layers: attention (GQA, MLA) with selectable cores, linear-recurrent mixers
(Gated DeltaNet, Mamba-2, KDA), SwiGLU MLP, FP8 linear layers."""

from dm_jax.nn.attention import GQAttention, MLAttention
from dm_jax.arms import ARMS
from dm_jax.nn.attention_core import attention_core, dot_product_attention
from dm_jax.nn.fp8 import Linear, RMSNorm, fp8_matmul
from dm_jax.nn.gated_deltanet import GatedDeltaNet
from dm_jax.nn.kda import KimiDeltaAttention
from dm_jax.nn.mamba2 import Mamba2
from dm_jax.nn.mlp import SwiGLU
from dm_jax.nn.recurrence import recurrent_chunked, recurrent_naive

__all__ = [
    "ARMS",
    "GQAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "Linear",
    "MLAttention",
    "Mamba2",
    "RMSNorm",
    "SwiGLU",
    "attention_core",
    "dot_product_attention",
    "fp8_matmul",
    "recurrent_chunked",
    "recurrent_naive",
]
