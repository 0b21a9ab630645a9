"""Probes: cross-entropy, attention masking and dS row-sum residual bookkeeping."""

import functools

import numpy as np
import pytest

from dm_jax.numerics import DELTA_MODES
from train.eval import cross_entropy, masking_probe, residual_probe, residual_ratio

V = 16


def _batch(seed=0, B=2, T=8):
    rng = np.random.default_rng(seed)
    return dict(
        tokens=rng.integers(0, V, (B, T)).astype(np.int32),
        targets=rng.integers(0, V, (B, T)).astype(np.int32),
        mask=np.ones((B, T), np.float32),
    )


def oracle(tokens_BT, *, segment_ids=None, ablate_attention_layers=(), targets=None):
    """Knows the targets unless layer 3 is ablated, then uniform."""
    B, T = tokens_BT.shape
    if 3 in ablate_attention_layers:
        return np.zeros((B, T, V), np.float32)
    return 5.0 * np.eye(V, dtype=np.float32)[targets]


def test_cross_entropy_uniform_and_masked():
    batch = _batch()
    uniform = lambda t, segment_ids=None: np.zeros(t.shape + (V,), np.float32)  # noqa: E731
    assert cross_entropy(uniform, [batch]) == pytest.approx(np.log(V))
    # Masked-out positions do not count: a model right only where the mask is 1.
    batch["mask"][:, 4:] = 0
    half = lambda t, segment_ids=None: np.where(
        np.arange(t.shape[1])[None, :, None] < 4,  # noqa: E731
        9.0 * np.eye(V)[batch["targets"]],
        0.0,
    )
    assert cross_entropy(half, [batch]) < 0.01
    batch["mask"][:] = 0
    with pytest.raises(ValueError, match="batches"):
        cross_entropy(uniform, [batch])


def test_masking_probe_reports_the_increase():
    batch = _batch()
    fn = lambda t, **kw: oracle(t, targets=batch["targets"], **kw)  # noqa: E731
    hurt = masking_probe(fn, [batch], layer=3)
    assert hurt.ce_masked == pytest.approx(np.log(V)) and hurt.increase > 2.0
    assert masking_probe(fn, [batch], layer=1).increase == pytest.approx(0.0)


def test_residual_probe_per_layer_and_mode():
    captured = {1: dict(q=1.0, k=0, v=0, do=0), 5: dict(q=2.0, k=0, v=0, do=0)}
    level = {"stale": 6.0, "do_matched": 3.0, "matched": 1.0}
    seen = []

    def row_sums(q, k, v, do, *, causal, delta, segment_ids):
        seen.append((causal, segment_ids is not None))
        r = np.full((1, 2, 4), q * level[delta] * 1e-3)
        return dict(pre_cast=r / 100, post_cast=r)

    stats = residual_probe(lambda t, y: captured, row_sums, _batch())
    assert [(s.layer, s.delta) for s in stats] == [(l, d) for l in (1, 5) for d in DELTA_MODES]
    assert all(seen_ == (True, False) for seen_ in seen)
    assert residual_ratio(stats) == {1: pytest.approx(6.0), 5: pytest.approx(6.0)}
    assert residual_ratio(stats, stage="pre_cast", numerator="do_matched") == {
        1: pytest.approx(3.0),
        5: pytest.approx(3.0),
    }


def test_residual_probe_on_real_activations():
    """On a small model's captured attention inputs, Delta-Matching zeroes the pre-cast dS
    row sums (FP32 rounding) while stale delta leaves a residual, before and after the cast."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dm_jax import diagnostics, models
    from train.experiments.evaluate import jit_with_model

    config = models.preset("gdn_gqa", "tiny", vocab_size=V)
    model = models.HybridLM(config, rngs=nnx.Rngs(0))
    batch = _batch(B=2, T=64)
    jitted = jit_with_model(model, models.attention_probe)
    probe = lambda t, y: jitted(jnp.asarray(t), jnp.asarray(y))  # noqa: E731
    row_sums = jax.jit(
        functools.partial(diagnostics.row_sum_residuals, implementation="reference"),
        static_argnames=("causal", "delta"),
    )
    stats = residual_probe(probe, row_sums, dict(batch, segments=None))
    by = {(s.layer, s.delta): s for s in stats}
    layers = sorted({s.layer for s in stats})
    assert layers == list(config.attention_layer_indices)
    for layer in layers:
        assert by[(layer, "matched")].pre_cast < 1e-5
        assert by[(layer, "stale")].pre_cast > 100 * by[(layer, "matched")].pre_cast
    assert all(r > 1.0 for r in residual_ratio(stats).values())
