"""Scanned layers: `scan_layers=True` runs the repeating layer group as one `lax.scan` and
must give the unscanned model's loss and gradients; `remat` policies likewise; the
parameter tree (and so every checkpoint) is the same with the switch on or off."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dm_jax.models import FAMILIES, HybridLM, preset
from train.checkpoint import fingerprint


# Per family the layer kind it adds, twice (gdn_gqa: a mixed group of two kinds, twice).
_PATTERNS = {
    "gdn_gqa": ("gdn", "attn") * 2,
    "mamba2_gqa": ("mamba2",) * 2,
    "kda_gqa": ("kda",) * 2,
    "gdn_mla": ("mla",) * 2,
    "gqa": ("attn",) * 2,
}


def _two_groups(family, **kw):
    """Tiny preset in float32 (naive mixers compile faster) whose layer group repeats twice."""
    return preset(
        family,
        attention="reference",
        compute_dtype="float32",
        ffn="bf16",
        mixer_impl="naive",
        pattern=_PATTERNS[family],
        **kw,
    )


def _loss_and_grads(cfg, tok, seg):
    """(model, jaxpr text, loss, parameter gradients) of the mean next-token CE."""
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params, rest)(tok[:, :-1], segment_ids=seg[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    traced = jax.jit(jax.value_and_grad(loss_fn)).trace(params)
    loss, grads = traced.lower().compile()(params)
    return model, str(traced.jaxpr), loss, grads


def _compare(cfg, *others):
    """Asserts that every config in `others` has `cfg`'s initial parameters, loss and
    gradients; returns the jaxpr texts, `cfg`'s first."""
    tok = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    seg = jnp.array([[0] * 9 + [1] * 8, [0] * 17], jnp.int32)
    model_a, jaxpr_a, loss_a, grads_a = _loss_and_grads(cfg, tok, seg)
    params_a, leaves_a = nnx.state(model_a, nnx.Param), jax.tree.leaves(grads_a)
    assert float(jnp.abs(leaves_a[-3]).max()) > 0  # gradients reach the layers
    jaxprs = [jaxpr_a]
    for other in others:
        model_b, jaxpr_b, loss_b, grads_b = _loss_and_grads(other, tok, seg)
        params_b = nnx.state(model_b, nnx.Param)
        assert fingerprint(params_a) == fingerprint(params_b)  # one tree: shared checkpoints
        for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
            np.testing.assert_array_equal(a, b)  # the same initialization
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
        leaves_b = jax.tree.leaves(grads_b)
        assert len(leaves_a) == len(leaves_b)
        for a, b in zip(leaves_a, leaves_b):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        jaxprs.append(jaxpr_b)
    return jaxprs


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_layers_match_unscanned(family):
    cfg = _two_groups(family)
    assert cfg.scan_layers and cfg.layer_repeats == 2 and cfg.num_params() > 0
    scanned, unscanned = _compare(cfg, dataclasses.replace(cfg, scan_layers=False))
    # The unscanned program holds every layer; the scanned one a single group.
    assert scanned.count("dot_general") < unscanned.count("dot_general")


def test_remat_policies_keep_gradients():
    cfg = _two_groups("gqa")
    base, full, dots = _compare(
        cfg,
        dataclasses.replace(cfg, remat="full"),
        dataclasses.replace(cfg, scan_layers=False, remat="dots"),
    )
    assert _rematerialises(full) and _rematerialises(dots) and not _rematerialises(base)


def _rematerialises(jaxpr: str) -> bool:
    return "checkpoint[" in jaxpr or "remat2[" in jaxpr


def test_layer_period_and_config_errors():
    assert preset("gdn_gqa", "569m").layer_period == 4
    assert preset("gdn_gqa", "569m").layer_repeats == 6
    assert preset("gqa", "small").layer_period == 1
    assert preset("gdn_gqa").layer_repeats == 1  # tiny: one group, nothing to scan
    odd = preset("gdn_gqa", pattern=("gdn", "attn", "gdn", "gdn", "attn"))
    assert odd.layer_period == 5 and odd.layer_repeats == 1
    with pytest.raises(ValueError, match="remat"):
        preset("gdn_gqa", remat="some")
