"""Scoring: a model that copies from its context beats one that cannot, on both metrics."""

import numpy as np
import pytest

from train.data import ByteTokenizer
from train.eval import (
    RulerConfig,
    answer_line,
    build_haystack,
    continuation_logprob,
    generate,
    greedy_generate,
    match_fraction,
    run_ruler,
    score_examples,
    summarize,
)

TOK = ByteTokenizer()
V = TOK.vocab_size


def copy_model(tokens_BT, min_match=4):
    """Induction 'model': after the longest earlier match of the current suffix, predict the
    token that followed it (logit 10 vs 0); uniform where no suffix of `min_match` recurs."""
    tokens_BT = np.asarray(tokens_BT)
    B, T = tokens_BT.shape
    logits = np.zeros((B, T, V), np.float32)
    for b in range(B):
        x, run = tokens_BT[b], np.zeros(T, np.int32)  # run[s]: match length ending at (t, s)
        for t in range(T):
            prev = np.concatenate([[0], run[:-1]])
            run = np.where(x == x[t], prev + 1, 0)
            run[t:] = 0  # only earlier positions s < t
            s = T - 1 - int(np.argmax(run[::-1]))  # latest longest match
            if run[s] >= min_match and s + 1 < T:
                logits[b, t, x[s + 1]] = 10.0
    return logits


def bigram_model(tokens_BT):
    """Cannot copy: predicts digits and letters uniformly, whatever the context."""
    B, T = np.asarray(tokens_BT).shape
    return np.zeros((B, T, V), np.float32)


@pytest.fixture(scope="module")
def niah():
    return generate("niah_single", 256, 4, haystack=build_haystack(), tokenizer=TOK)


def test_match_fraction_on_constructed_outputs():
    assert match_fraction(" 1234567, 7654321.", ("1234567", "7654321")) == 1.0
    assert match_fraction("1234567 and junk", ("1234567", "7654321")) == 0.5
    assert match_fraction("  ABCDE\n", ("abcde",)) == 1.0
    assert match_fraction("123456", ("1234567",)) == 0.0


def test_greedy_generate_emits_the_model_argmax():
    def next_is_plus_one(tokens_BT):
        tokens_BT = np.asarray(tokens_BT)
        return np.eye(V, dtype=np.float32)[(tokens_BT + 1) % V]

    out = greedy_generate(next_is_plus_one, [[1, 2], [10]], 3, length=8, rows=4)
    assert out == [[3, 4, 5], [11, 12, 13]]
    # Stops once every row is done; the scorer then reads only the first non-blank line.
    calls = []
    counting = lambda t: calls.append(1) or next_is_plus_one(t)  # noqa: E731
    out = greedy_generate(counting, [[1], [7]], 5, length=8, done=lambda ids: 9 in ids or 4 in ids)
    assert out == [[2, 3, 4], [8, 9, 10]] and len(calls) == 3
    assert answer_line("\n  \n 123, 456.\nmore 789") == " 123, 456."


def test_copy_model_finds_the_needle(niah):
    copy = score_examples(copy_model, TOK, niah)
    blind = score_examples(bigram_model, TOK, niah)
    assert copy.exact_match == 1.0 and copy.partial_match == 1.0
    assert blind.exact_match == 0.0
    assert copy.gold_logprob > -0.5 > np.log(1 / V) - 1e-6 >= blind.gold_logprob - 1e-6
    # Against a wrong number of the same form: the copier prefers the gold, the blind model cannot.
    assert copy.margin > 1.0 and copy.choice == 1.0
    assert blind.margin == pytest.approx(0.0, abs=1e-9) and blind.choice == 0.0


def test_likelihood_separates_gold_from_a_wrong_value(niah):
    prompts = [TOK.encode(e.prompt) for e in niah]
    gold = continuation_logprob(copy_model, prompts, [TOK.encode(e.target) for e in niah])
    wrong = continuation_logprob(copy_model, prompts, [TOK.encode(" 1111111.") for _ in niah])
    assert np.all(gold > wrong + 1.0)


def test_run_ruler_scores_every_task_and_length():
    config = RulerConfig(
        context_lengths=(512,), tasks=("niah_single", "frequent_words"), examples=2, generate=False
    )
    scores = run_ruler(bigram_model, TOK, config)
    assert [(s.task, s.context_length) for s in scores] == [
        ("niah_single", 512),
        ("frequent_words", 512),
    ]
    assert np.isnan(scores[0].exact_match)
    assert summarize(scores)[512]["gold_logprob"] == pytest.approx(np.log(1 / V), rel=1e-5)
    assert summarize(scores)[512]["margin"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="tasks"):
        RulerConfig(tasks=("bogus",))
