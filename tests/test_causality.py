"""Causality and independence of the tiny models with every FP8 precision scope, bit for bit.

* FP8 linear layers (ffn, attn_proj), per-token scaling: changing the tokens after position
  t changes no logit up to t; changing one packed document, or one sequence of the batch,
  changes no logit of another. Per-tensor scaling breaks all three (the check can fail).
* The FP8 attention core scales Q/K/V per 128-token block (docs/numerics.md): the same holds
  at block granularity; inside a block, a later token can move an earlier token's scale
  (tests/test_attention_causality.py measures that effect).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dm_jax.models import FAMILIES, HybridLM, preset
from dm_jax.numerics import SCALE_BLOCK

LINEAR_FP8 = {"attention": "reference", "ffn": "fp8", "attn_proj": "fp8"}
_forward = nnx.jit(lambda m, tok, seg: m(tok, segment_ids=seg))


def _changed(tok, where):
    """tok with the tokens at `where` (an index expression) replaced by other tokens."""
    return tok.at[where].set((tok[where] + 7) % 256)


def _leaks(family, t, cut, **kw):
    """Largest logit change over three edits that must change nothing:
    (future) tokens after `cut` of both rows -> logits up to `cut`;
    (document) row 0's first document (tokens before `cut`) -> its second document;
    (batch) row 0 entirely -> row 1."""
    cfg = preset(family, **kw)
    # the family's last two layers (its mixer kind and its attention kind): a short compile
    model = HybridLM(dataclasses.replace(cfg, pattern=cfg.pattern[-2:]), rngs=nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(1), (2, t), 0, 256)
    seg = jnp.stack([(jnp.arange(t) >= cut).astype(jnp.int32), jnp.zeros(t, jnp.int32)])
    base = _forward(model, tok, seg)
    future = _forward(model, _changed(tok, (slice(None), slice(cut + 1, None))), seg)
    doc = _forward(model, _changed(tok, (0, slice(0, cut))), seg)
    row = _forward(model, _changed(tok, (0,)), seg)
    assert float(jnp.abs(future[:, cut + 1 :] - base[:, cut + 1 :]).max()) > 0  # edits bite
    diff = lambda a, b: float(jnp.abs(a - b).max())
    return {
        "future": diff(future[:, : cut + 1], base[:, : cut + 1]),
        "document": diff(doc[0, cut:], base[0, cut:]),
        "batch": diff(row[1], base[1]),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_linear_layers_are_exactly_causal_and_independent(family):
    assert _leaks(family, 64, 40, **LINEAR_FP8) == {"future": 0, "document": 0, "batch": 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_fp8_scope_is_exactly_causal_per_scale_block(family):
    # the default arm: FP8 FFN, attention projections and attention core
    cfg = preset(family)
    assert cfg.ffn == "fp8" and cfg.attn_proj_fp8 and cfg.attn_core_precision == "fp8"
    leaks = _leaks(family, SCALE_BLOCK + 24, SCALE_BLOCK - 1)
    assert leaks == {"future": 0, "document": 0, "batch": 0}


def test_per_tensor_scaling_leaks_across_tokens_and_sequences():
    # the case: the tiny Mamba-2 hybrid, reference attention, FP8 FFN
    leaks = _leaks("mamba2_gqa", 64, 40, attention="reference", fp8_scaling="per_tensor")
    assert leaks["future"] > 0, leaks
