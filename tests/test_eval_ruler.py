"""The RULER-style generators: answers really are in the text, lengths fit, deterministic."""

import collections
import re

import pytest

from train.data import ByteTokenizer
from train.eval import TASKS, build_haystack, generate

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def haystack():
    return build_haystack()


def _examples(haystack, task, length=512, n=3, seed=0):
    return generate(task, length, n, haystack=haystack, tokenizer=TOK, seed=seed)


@pytest.mark.parametrize("task", TASKS)
def test_fits_and_fills_context(haystack, task):
    for length in (512, 1024):
        for ex in _examples(haystack, task, length):
            used = len(TOK.encode(ex.prompt + ex.target))
            assert 0.85 * length <= used <= length, (task, length, used)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(haystack, task):
    assert _examples(haystack, task) == _examples(haystack, task)
    assert _examples(haystack, task) != _examples(haystack, task, seed=1)


@pytest.mark.parametrize(
    "task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]
)
def test_needles_hold_the_gold_values(haystack, task):
    for ex in _examples(haystack, task):
        question = ex.prompt[ex.prompt.index("\nQuestion:") :]
        keys = re.search(r"numbers? for (.+) did the text", question).group(1).split(", ")
        found = [
            v
            for k in keys
            for v in re.findall(rf"numbers for {re.escape(k)} is: (\d+)\.", ex.prompt)
        ]
        assert sorted(found) == sorted(ex.answers)
        if task == "niah_multivalue":  # several values are asked in text order
            assert list(ex.answers) == sorted(ex.answers, key=ex.prompt.index)
        # Distractor keys (multikey) carry other values that are not gold.
        all_values = re.findall(r"is: (\d{7})\.", ex.prompt)
        assert len(all_values) == {"niah_single": 1}.get(task, 4)
        # The likelihood distractor: same count and form; in the text exactly for multikey.
        assert len(ex.distractors) == len(ex.answers) and not set(ex.distractors) & set(ex.answers)
        assert all(re.fullmatch(r"\d{7}", d) for d in ex.distractors)
        assert all((d in all_values) == (task == "niah_multikey") for d in ex.distractors)


def test_variable_chain_resolves_to_the_answers(haystack):
    for ex in _examples(haystack, "variable_tracking"):
        value = re.search(r"assigned the value (\d+)\.", ex.prompt).group(1)
        env = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", ex.prompt):
            env[name] = env[rhs[4:]] if rhs.startswith("VAR ") else rhs  # defined before use
        assert sorted(n for n, v in env.items() if v == value) == sorted(ex.answers)
        assert all(re.fullmatch(r"[A-Z]{5}", d) and d not in ex.prompt for d in ex.distractors)


@pytest.mark.parametrize("task,top", [("common_words", 5), ("frequent_words", 3)])
def test_word_tasks_answer_is_strictly_most_frequent(haystack, task, top):
    for ex in _examples(haystack, task):
        body = ex.prompt.split("\n")[1]
        counts = collections.Counter(re.findall(r"[a-z]+", body))
        assert len(ex.answers) == top
        rest = max(c for w, c in counts.items() if w not in ex.answers)
        assert min(counts[a] for a in ex.answers) > rest
        # Distractors: words of the list, rarer than every answer.
        assert len(ex.distractors) == top and max(counts[d] for d in ex.distractors) < min(
            counts[a] for a in ex.answers
        )


def test_too_short_context_is_a_clear_error(haystack):
    with pytest.raises(ValueError, match="context_length"):
        generate("niah_multiquery", 128, 1, haystack=haystack, tokenizer=TOK)
    with pytest.raises(ValueError, match="task"):
        generate("nope", 512, 1, haystack=haystack, tokenizer=TOK)
