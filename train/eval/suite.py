"""The long-context suite: every RULER-style task at every chosen context length."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from train.eval.haystack import Haystack, build_haystack
from train.eval.ruler import TASKS, Tokenizer, generate
from train.eval.scoring import LogitsFn, TaskScore, score_examples


@dataclasses.dataclass(frozen=True)
class RulerConfig:
    """Which tasks, lengths (tokens, answer included) and how many examples of each."""

    context_lengths: tuple[int, ...] = (512,)
    tasks: tuple[str, ...] = TASKS
    examples: int = 8
    batch_size: int = 8
    generate: bool = True  # greedy exact match; False scores only the gold likelihood
    seed: int = 0

    def __post_init__(self):
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"tasks: unknown {unknown}; known: {TASKS}")
        if not self.context_lengths or min(self.context_lengths) < 64:
            raise ValueError(f"context_lengths: need lengths >= 64, got {self.context_lengths}")
        if self.examples < 1 or self.batch_size < 1:
            raise ValueError(
                f"examples, batch_size: must be >= 1, got {self.examples}, {self.batch_size}"
            )


def run_ruler(
    logits_fn: LogitsFn,
    tokenizer: Tokenizer,
    config: RulerConfig = RulerConfig(),
    *,
    haystack: Optional[Haystack] = None,
    pad_id: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> list[TaskScore]:
    """Scores `logits_fn` on every (task, length) of `config`; the prompts depend only on
    `config` (and the tokenizer), so every model sees the same examples."""
    haystack = haystack or build_haystack()
    scores = []
    for length in config.context_lengths:
        for task in config.tasks:
            examples = generate(
                task,
                length,
                config.examples,
                haystack=haystack,
                tokenizer=tokenizer,
                seed=config.seed,
            )
            score = score_examples(
                logits_fn,
                tokenizer,
                examples,
                batch_size=config.batch_size,
                pad_id=pad_id,
                generate=config.generate,
            )
            log(
                f"  {task}@{length}: exact {score.exact_match:.3f} logprob {score.gold_logprob:.3f} "
                f"margin {score.margin:.3f}"
            )
            scores.append(score)
    return scores


def summarize(scores: list[TaskScore]) -> dict[int, dict[str, float]]:
    """Per context length: each `TaskScore` metric averaged over tasks."""
    out = {}
    for length in sorted({s.context_length for s in scores}):
        group = [s for s in scores if s.context_length == length]
        out[length] = {
            k: sum(getattr(s, k) for s in group) / len(group)
            for k in ("exact_match", "partial_match", "gold_logprob", "margin", "choice")
        }
    return out
