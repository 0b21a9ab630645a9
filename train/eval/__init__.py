"""Evaluation: validation cross-entropy, a RULER-style long-context suite, model probes.

Everything takes a model callable and a tokenizer, not training internals:
  logits_fn(tokens_BT int32 [B, T]) -> logits [B, T, V]
  tokenizer.encode(str) -> ids, tokenizer.decode(ids) -> str
"""

from train.eval.haystack import Haystack, build_haystack
from train.eval.probes import (
    DELTA_MODES,
    MaskingResult,
    ResidualStats,
    cross_entropy,
    masking_probe,
    residual_probe,
    residual_ratio,
)
from train.eval.ruler import TASKS, RulerExample, generate
from train.eval.scoring import (
    TaskScore,
    answer_line,
    continuation_logprob,
    greedy_generate,
    match_fraction,
    score_examples,
)
from train.eval.suite import RulerConfig, run_ruler, summarize

__all__ = [
    "Haystack",
    "build_haystack",
    "DELTA_MODES",
    "MaskingResult",
    "ResidualStats",
    "cross_entropy",
    "masking_probe",
    "residual_probe",
    "residual_ratio",
    "TASKS",
    "RulerExample",
    "generate",
    "TaskScore",
    "answer_line",
    "continuation_logprob",
    "greedy_generate",
    "match_fraction",
    "score_examples",
    "RulerConfig",
    "run_ruler",
    "summarize",
]
