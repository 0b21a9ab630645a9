"""Evaluate one trained run: validation CE, long-context suite, masking and residual probes,
and the final QK-norm channel-gain statistics."""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train import data as data_lib
from train import loop
from train.eval import masking_probe, residual_probe, residual_ratio, run_ruler, summarize
from train.experiments.presets import ComparePreset


def jit_with_model(model, fn: Callable, static_argnames: tuple[str, ...] = ()) -> Callable:
    """`fn(model, *args, **kwargs)` jitted over the model's state: returns a callable of
    (*args, **kwargs) (one compile per input shape and static arguments)."""
    graphdef, state = nnx.split(model)
    jitted = jax.jit(
        lambda state, *a, **kw: fn(nnx.merge(graphdef, state), *a, **kw),
        static_argnames=static_argnames,
    )
    return functools.partial(jitted, state)


def model_logits_fn(model) -> Callable:
    """A jitted `logits_fn(tokens_BT, *, segment_ids=None, ablate_attention_layers=()) -> [B,T,V]`
    of a language model taking those arguments."""
    forward = jit_with_model(
        model,
        lambda m, t, s, ablate: m(t, segment_ids=s, ablate_attention_layers=ablate),
        static_argnames=("ablate",),
    )

    def logits_fn(tokens_BT, *, segment_ids=None, ablate_attention_layers=()):
        segments = None if segment_ids is None else jnp.asarray(segment_ids)
        return forward(jnp.asarray(tokens_BT), segments, ablate=tuple(ablate_attention_layers))

    return logits_fn


def final_gains(model, hooks) -> dict[int, dict[str, float]]:
    """{layer: {max_gain, top1_share, top4_share}} of every QK-norm pair ({} without QK-norm)."""
    if hooks.qk_gains is None or hooks.gain_statistics is None:
        return {}
    out = {}
    for layer, (g_q, g_k) in sorted(hooks.qk_gains(model).items()):
        stats = hooks.gain_statistics(g_q, g_k)
        out[int(layer)] = {
            k: float(np.asarray(stats[k]).max()) for k in ("max_gain", "top1_share", "top4_share")
        }
    return out


def _masking(model, cfg, preset, batches, logits_fn) -> dict:
    layers = list(cfg.model_config.attention_layer_indices)
    if not layers:
        return {}
    masked = masking_probe(logits_fn, batches, layers[-1])
    return dict(
        val_ce=masked.ce, masking=dataclasses.asdict(masked) | {"increase": masked.increase}
    )


def _residuals(model, cfg, preset, batches, hooks, implementation) -> dict:
    """dS row-sum residuals of every attention layer, all delta modes, on `preset.probe_rows`
    sequences of the first validation batch."""
    if hooks.attention_probe is None or hooks.row_sum_residuals is None:
        return {}
    rows = {k: (None if v is None else v[: preset.probe_rows]) for k, v in batches[0].items()}
    probe = jit_with_model(model, lambda m, t, y, s: hooks.attention_probe(m, t, y, segment_ids=s))
    row_sums = jax.jit(
        functools.partial(hooks.row_sum_residuals, implementation=implementation),
        static_argnames=("causal", "delta"),
    )
    segments = None if rows["segments"] is None else jnp.asarray(rows["segments"])
    stats = residual_probe(
        lambda t, y: probe(jnp.asarray(t), jnp.asarray(y), segments), row_sums, rows
    )
    return dict(
        residuals=[dataclasses.asdict(s) for s in stats],
        residual_ratio_post=residual_ratio(stats),
        residual_ratio_pre=residual_ratio(stats, stage="pre_cast"),
    )


def _residuals_or_reference(model, cfg, preset, batches, hooks, implementation, log) -> dict:
    try:
        return _residuals(model, cfg, preset, batches, hooks, implementation)
    except Exception as e:  # noqa: BLE001 - retried below
        if implementation == "reference":
            raise
        log(
            f"    implementation {implementation or 'default'} failed ({type(e).__name__}: {e}); "
            "using the reference implementation"
        )
        return dict(
            _residuals(model, cfg, preset, batches, hooks, "reference"),
            residual_implementation="reference",
        )


def _ruler(cfg, preset, logits_fn, log) -> dict:
    scores = run_ruler(logits_fn, data_lib.make_tokenizer(cfg.data), preset.ruler, log=log)
    return dict(ruler=[dataclasses.asdict(s) for s in scores], ruler_summary=summarize(scores))


def evaluate_run(
    run_dir: str,
    preset: ComparePreset,
    *,
    log: Callable[[str], None] = print,
    hooks=None,
    on_part: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Every evaluation of the run in `run_dir` as a JSON-ready dict (see `report.py`).

    Each part runs on its own: one that fails is logged and named in `errors` (part ->
    message) and the others still run. The residual probe falls back to the reference
    implementation when the run's own one cannot compute it. `on_part(results so far)` is
    called after every part, so a caller can keep them if the process is stopped."""
    from train import model as model_lib

    hooks = hooks or model_lib.default_hooks()
    model, cfg = loop.load_model(run_dir, hooks=hooks)
    logits_fn = model_logits_fn(model)
    _, val = data_lib.make_batches(cfg, data_lib.load_splits(cfg.data), validation=True)
    batches = [val.batch(i) for i in range(preset.val_batches)]
    if cfg.data.packing != "segments":
        batches = [dict(b, segments=None) for b in batches]
    impl = dict(cfg.model.overrides).get("attention_implementation")
    parts = [
        ("gains", lambda: dict(gains=final_gains(model, hooks))),
        (
            "validation CE and masking probe",
            lambda: _masking(model, cfg, preset, batches, logits_fn),
        ),
        (
            "dS row-sum residual probe",
            lambda: _residuals_or_reference(model, cfg, preset, batches, hooks, impl, log),
        ),
        ("long-context suite", lambda: _ruler(cfg, preset, logits_fn, log)),
    ]
    out: dict = {"errors": {}}
    for name, part in parts:
        log(f"  {name}")
        start = time.perf_counter()
        try:
            out.update(part())
        except Exception as e:  # noqa: BLE001 - reported, the other parts still run
            traceback.print_exc()
            out["errors"][name] = f"{type(e).__name__}: {e}"
        log(f"    {time.perf_counter() - start:.1f} s")
        if on_part is not None:
            on_part(dict(out, errors=dict(out["errors"])))
    return out
