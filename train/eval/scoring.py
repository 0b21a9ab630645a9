"""Scoring a causal LM on prompted tasks: greedy exact match, gold-answer log-likelihood and
its margin over a distractor answer.

The model is any callable `logits_fn(tokens_BT int32 [B, T]) -> logits [B, T, V]` of a
causal LM. Batches are right-padded to a fixed [rows, length] (causality makes the padding
harmless), so a jitted `logits_fn` compiles once per context length.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

import numpy as np

from train.eval.ruler import RulerExample, Tokenizer

LogitsFn = Callable[[np.ndarray], "np.ndarray"]
_MAX_NEW = 64  # room past the context length for greedy answers


def _pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, rows: int = 0) -> np.ndarray:
    """int32 [max(rows, len(seqs)), length]: each sequence left-aligned, then `pad_id`."""
    if max(map(len, seqs)) > length:
        raise ValueError(
            f"length: {length} is shorter than a sequence of {max(map(len, seqs))} tokens"
        )
    out = np.full((max(rows, len(seqs)), length), pad_id, np.int32)
    for row, seq in zip(out, seqs):
        row[: len(seq)] = seq
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def greedy_generate(
    logits_fn: LogitsFn,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    pad_id: int = 0,
    length: int = 0,
    rows: int = 0,
    done: Optional[Callable[[list[int]], bool]] = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt: up to `max_new_tokens` ids per prompt.

    Runs one full forward pass per new token over a [max(rows, N), L] buffer (no KV cache;
    L = `length`, or the longest prompt + `max_new_tokens` rounded up to 128): simple and
    exact for any causal model, fine for the short answers tasks need. Stops early once
    `done(ids so far)` holds for every prompt (all outputs then have the same length).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    lengths = np.array([len(p) for p in prompts])
    if lengths.min() < 1:
        raise ValueError("prompts: every prompt needs at least one token")
    need = int(lengths.max()) + max_new_tokens
    buf_BL = _pad(prompts, length or _round_up(need, 128), pad_id, rows)
    if need > buf_BL.shape[1]:
        raise ValueError(
            f"length: {buf_BL.shape[1]} cannot hold a prompt and {max_new_tokens} new tokens"
        )
    rows = np.arange(len(prompts))
    new = lambda steps: [buf_BL[i, lengths[i] : lengths[i] + steps].tolist() for i in rows]  # noqa: E731
    for step in range(max_new_tokens):
        pos = lengths + step
        logits_BLV = np.asarray(logits_fn(buf_BL))
        buf_BL[rows, pos] = logits_BLV[rows, pos - 1].argmax(-1)
        if done is not None and all(map(done, new(step + 1))):
            return new(step + 1)
    return new(max_new_tokens)


def continuation_logprob(
    logits_fn: LogitsFn,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    length: int = 0,
    rows: int = 0,
) -> np.ndarray:
    """Mean log-probability per token (nats) of each continuation given its prompt: [N].

    `length`, `rows`: the padded batch shape, as in `greedy_generate`."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    tokens_BL = _pad(seqs, length or _round_up(max(map(len, seqs)), 128), pad_id, rows)
    logp_BLV = _log_softmax(np.asarray(logits_fn(tokens_BL), np.float64))
    out = np.empty(len(seqs))
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        pos = np.arange(len(p), len(p) + len(c))
        out[i] = logp_BLV[i, pos - 1, tokens_BL[i, pos]].mean()
    return out


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def answer_line(text: str) -> str:
    """The first non-blank line of a generated text: what is scored as the answer."""
    return next((line for line in text.split("\n") if line.strip()), "")


def match_fraction(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of gold `answers` found in `prediction` (case- and space-insensitive)."""
    pred = _normalize(prediction)
    return sum(_normalize(a) in pred for a in answers) / len(answers)


@dataclasses.dataclass(frozen=True)
class TaskScore:
    """Scores of one task at one context length, averaged over its examples.

    exact_match: share of examples whose greedy answer line contains every gold answer.
    partial_match: mean share of gold answers found in the greedy answer line.
    gold_logprob: mean per-token log-likelihood (nats) of the gold answer text.
    margin: mean of gold minus distractor per-token log-likelihood (0 for a model that
      cannot tell them apart; > 0 when it retrieves the gold answer).
    choice: share of examples where the gold answer is more likely than the distractor.
    """

    task: str
    context_length: int
    n: int
    exact_match: float
    partial_match: float
    gold_logprob: float
    margin: float
    choice: float


def score_examples(
    logits_fn: LogitsFn,
    tokenizer: Tokenizer,
    examples: Sequence[RulerExample],
    *,
    batch_size: int = 8,
    pad_id: int = 0,
    generate: bool = True,
) -> TaskScore:
    """Scores examples of one task and length (see `TaskScore`); `generate=False` skips
    greedy decoding (exact/partial match are then NaN) and only scores the likelihood."""
    if not examples or len({(e.task, e.context_length) for e in examples}) != 1:
        raise ValueError("examples: need a non-empty list of one task at one context length")
    em, pm, lp, wrong = [], [], [], []
    # One [batch_size, length] shape for every task at this context length: one compile.
    length = _round_up(examples[0].context_length + _MAX_NEW, 128)
    shape = dict(pad_id=pad_id, length=length, rows=batch_size)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [list(tokenizer.encode(e.prompt)) for e in chunk]
        golds = [list(tokenizer.encode(e.target)) for e in chunk]
        lp += continuation_logprob(logits_fn, prompts, golds, **shape).tolist()
        distractors = [list(tokenizer.encode(e.distractor_target)) for e in chunk]
        wrong += continuation_logprob(logits_fn, prompts, distractors, **shape).tolist()
        if generate:
            new_tokens = min(max(map(len, golds)) + 4, length - max(map(len, prompts)))
            line_ended = lambda ids: "\n" in tokenizer.decode(ids).lstrip()  # noqa: E731
            outs = greedy_generate(logits_fn, prompts, new_tokens, done=line_ended, **shape)
            fractions = [
                match_fraction(answer_line(tokenizer.decode(o)), e.answers)
                for o, e in zip(outs, chunk)
            ]
            pm += fractions
            em += [float(f == 1.0) for f in fractions]
    nan, lp, wrong = float("nan"), np.array(lp), np.array(wrong)
    return TaskScore(
        examples[0].task,
        examples[0].context_length,
        len(examples),
        float(np.mean(em)) if em else nan,
        float(np.mean(pm)) if pm else nan,
        float(lp.mean()),
        float((lp - wrong).mean()),
        float((lp > wrong).mean()),
    )
