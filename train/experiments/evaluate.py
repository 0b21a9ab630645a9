"""Evaluate one trained run: validation CE, long-context suite, masking and residual probes,
and the final QK-norm channel-gain statistics."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train import data as data_lib
from train import loop
from train.eval import (masking_probe, residual_probe, residual_ratio, run_ruler, summarize)
from train.experiments.presets import ComparePreset


def jit_with_model(model, fn: Callable, static_argnames: tuple[str, ...] = ()) -> Callable:
    """`fn(model, *args, **kwargs)` jitted over the model's state: returns a callable of
    (*args, **kwargs) (one compile per input shape and static arguments)."""
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda state, *a, **kw: fn(nnx.merge(graphdef, state), *a, **kw),
                     static_argnames=static_argnames)
    return functools.partial(jitted, state)


def model_logits_fn(model) -> Callable:
    """A jitted `logits_fn(tokens_BT, *, segment_ids=None, ablate_attention_layers=()) -> [B,T,V]`
    of a language model taking those arguments."""
    forward = jit_with_model(model, lambda m, t, s, ablate: m(t, segment_ids=s, ablate_attention_layers=ablate),
                             static_argnames=("ablate",))

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
        out[int(layer)] = {k: float(np.asarray(stats[k]).max()) for k in ("max_gain", "top1_share", "top4_share")}
    return out


def evaluate_run(run_dir: str, preset: ComparePreset, *, log: Callable[[str], None] = print,
                 hooks=None) -> dict:
    """Every evaluation of the run in `run_dir` as a JSON-ready dict (see `report.py`)."""
    from train import model as model_lib

    hooks = hooks or model_lib.default_hooks()
    model, cfg = loop.load_model(run_dir, hooks=hooks)
    logits_fn = model_logits_fn(model)
    splits = data_lib.load_splits(cfg.data)
    _, val = data_lib.make_batches(cfg, splits)
    batches = [val.batch(i) for i in range(preset.val_batches)]
    if cfg.data.packing != "segments":
        batches = [dict(b, segments=None) for b in batches]
    layers = list(cfg.model_config.attention_layer_indices)
    out: dict = {"gains": final_gains(model, hooks)}

    log("  validation CE and masking probe")
    masked = masking_probe(logits_fn, batches, layers[-1]) if layers else None
    out["val_ce"] = masked.ce if masked else None
    out["masking"] = dataclasses.asdict(masked) | {"increase": masked.increase} if masked else None

    if hooks.attention_probe is not None and hooks.row_sum_residuals is not None and layers:
        log("  dS row-sum residual probe")
        rows = {k: (None if v is None else v[: preset.probe_rows]) for k, v in batches[0].items()}
        impl = dict(cfg.model.overrides).get("attention_implementation")
        probe = jit_with_model(model, lambda m, t, y, s: hooks.attention_probe(m, t, y, segment_ids=s))
        row_sums = jax.jit(functools.partial(hooks.row_sum_residuals, implementation=impl),
                           static_argnames=("causal", "delta"))
        segments = None if rows["segments"] is None else jnp.asarray(rows["segments"])
        stats = residual_probe(lambda t, y: probe(jnp.asarray(t), jnp.asarray(y), segments), row_sums, rows)
        out["residuals"] = [dataclasses.asdict(s) for s in stats]
        out["residual_ratio_post"] = residual_ratio(stats)
        out["residual_ratio_pre"] = residual_ratio(stats, stage="pre_cast")

    log("  long-context suite")
    tokenizer = data_lib.make_tokenizer(cfg.data)
    scores = run_ruler(logits_fn, tokenizer, preset.ruler, log=log)
    out["ruler"] = [dataclasses.asdict(s) for s in scores]
    out["ruler_summary"] = summarize(scores)
    return out
