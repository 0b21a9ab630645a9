"""Model hooks for comparisons on concatenated data.

With `packing="concat"` every token of a window belongs to one stream: the segment ids the
trainer passes are all equal and change nothing, but cuDNN's FP8 attention accepts no
segment ids at all. `concat_hooks` wraps the model so that it ignores them; every arm of a
comparison uses the same wrapper, so the arms stay identical apart from attention.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from flax import nnx

from train import model as model_lib


class IgnoreSegments(nnx.Module):
    """`model(tokens_BT, *, segment_ids=None, **kw)` -> `inner(tokens_BT, **kw)`."""

    def __init__(self, inner: nnx.Module):
        self.inner = inner

    @property
    def config(self):
        """The wrapped model's config (the trainer reads e.g. its vocabulary size)."""
        return self.inner.config

    def __call__(self, tokens_BT, *, segment_ids=None, **kwargs):
        del segment_ids  # all equal under concatenation
        return self.inner(tokens_BT, **kwargs)


def concat_hooks(base: Optional[model_lib.ModelHooks] = None) -> model_lib.ModelHooks:
    """`base` (default: `train.model.default_hooks()`) with models wrapped in `IgnoreSegments`."""
    base = base or model_lib.default_hooks()

    def probe(model, tokens_BT, targets_BT, *, segment_ids=None):
        del segment_ids
        return base.attention_probe(model.inner, tokens_BT, targets_BT)

    return dataclasses.replace(
        base,
        build=lambda cfg: IgnoreSegments(base.build(cfg)),
        qk_gains=None if base.qk_gains is None else (lambda model: base.qk_gains(model.inner)),
        attention_probe=None if base.attention_probe is None else probe,
    )


def hooks_for(packing: str) -> Optional[model_lib.ModelHooks]:
    """The hooks a comparison trains and evaluates with (None: the trainer's defaults)."""
    return concat_hooks() if packing == "concat" else None
