"""RULER-style synthetic long-context tasks, generated offline and deterministically.

Each example is a prompt of at most `context_length` tokens (answer included) and the gold
answers. Tasks:

- `niah_single`: one "special magic number" sentence hidden in prose; asked for its value.
- `niah_multikey`: four needles with different keys; asked for one key's value.
- `niah_multivalue`: one key with four values; asked for all of them.
- `niah_multiquery`: four keys; asked for all four values.
- `variable_tracking`: a chain of `VAR A = VAR B` assignments from one number, hidden in
  prose; asked for every variable holding the number.
- `common_words`: a numbered word list where ten words repeat much more than the rest;
  asked for the ten most common.
- `frequent_words`: coded nonsense words with Zipf-like counts; asked for the top three.

Token counts use the caller's tokenizer (`encode(str) -> list[int]`), so the same suite
works for byte-level and subword vocabularies.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import string
from typing import Callable, Protocol, Sequence

from train.eval.haystack import Haystack

TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _continuation(items: Sequence[str]) -> str:
    return " " + ", ".join(items) + "."


@dataclasses.dataclass(frozen=True)
class RulerExample:
    """One task instance: `prompt` ends with the answer prefix; `answers` are the gold strings.

    `distractors`: as many wrong answers of the same form (a value of another key, a rarer
    word of the list, a fresh number or name), so that the likelihood of `target` (all
    answers, in order) can be compared with that of `distractor_target`.
    """

    task: str
    context_length: int
    prompt: str
    answers: tuple[str, ...]
    distractors: tuple[str, ...]

    @property
    def target(self) -> str:
        return _continuation(self.answers)

    @property
    def distractor_target(self) -> str:
        return _continuation(self.distractors)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _fresh(rng: random.Random, make, count: int, text: str) -> list[str]:
    """`count` distinct strings from `make(rng)` that do not occur in `text`."""
    out: list[str] = []
    while len(out) < count:
        item = make(rng)
        if item not in text and item not in out:
            out.append(item)
    return out


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _key(rng: random.Random, hay: Haystack) -> str:
    return rng.choice(hay.words)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


class _Budget:
    """Counts tokens of a prompt under construction against `context_length`."""

    def __init__(self, tok: Tokenizer, context_length: int, fixed: str, answers: Sequence[str]):
        reserve = len(tok.encode(_continuation(answers))) + 1
        self.tok = tok
        self.left = context_length - reserve - len(tok.encode(fixed))
        if self.left <= 0:
            raise ValueError(
                f"context_length: {context_length} tokens cannot hold the task's fixed text"
            )

    def take(self, text: str, sep: str = " ") -> bool:
        """Spend the tokens of `text + sep` if they fit; say whether they did."""
        cost = len(self.tok.encode(text + sep))
        if cost > self.left:
            return False
        self.left -= cost
        return True


def _prose_with_inserts(rng, hay, budget: _Budget, inserts: Sequence[str]) -> str:
    """Consecutive haystack sentences filling the budget, `inserts` placed at random depths."""
    for text in inserts:
        if not budget.take(text):
            raise ValueError("context_length: too short for the task's needles")
    filler, misses, i = [], 0, rng.randrange(len(hay.sentences))
    while misses < 20:  # skip sentences too long for what is left; stop when none fit
        sentence = hay.sentences[i % len(hay.sentences)]
        fits = budget.take(sentence)
        filler += [sentence] if fits else []
        misses = 0 if fits else misses + 1
        i += 1
    slots = sorted(rng.randrange(len(filler) + 1) for _ in inserts)
    for offset, (slot, text) in enumerate(zip(slots, inserts)):
        filler.insert(slot + offset, text)
    return " ".join(filler)


def _niah(rng, hay, tok, n, *, n_keys, n_values, n_queries):
    keys = list(dict.fromkeys(_key(rng, hay) for _ in range(4 * n_keys)))[:n_keys]
    values = {k: [_number(rng) for _ in range(n_values)] for k in keys}
    asked = keys[:n_queries]
    needles = [_needle(k, v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    # Several values of one key are asked in the order the text gives them.
    answers = [v for k in asked for needle in needles for v in values[k] if needle == _needle(k, v)]
    what, verb = ("numbers", "are") if len(answers) > 1 else ("number", "is")
    keys_text = ", ".join(asked)
    # The answer prefix repeats the needle's own words, so a model that copies can answer.
    tail = (
        f"\nQuestion: What special magic {what} for {keys_text} did the text mention?"
        f"\nAnswer: The special magic {what} for {keys_text} {verb}:"
    )
    head = "Remember the special magic numbers hidden in this text.\n"
    budget = _Budget(tok, n, head + tail, answers)
    prompt = head + _prose_with_inserts(rng, hay, budget, needles) + tail
    # Values of keys not asked for are in the text: the likelihood must tell them apart.
    others = [v for k in keys[n_queries:] for v in values[k]][: len(answers)]
    return prompt, answers, others + _fresh(rng, _number, len(answers) - len(others), prompt)


def _variable_tracking(rng, hay, tok, n, *, hops=4):
    names = _fresh(rng, _name, hops + 1, "")
    value = _number(rng)[:5]
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)
    ]
    tail = f"\nQuestion: Find all variables that are assigned the value {value}.\nAnswer: The variables assigned {value} are:"
    head = "Memorize and track the chain of variable assignments hidden in the following text.\n"
    budget = _Budget(tok, n, head + tail, names)
    # Insert the chain in order: the depths are sorted, so assignment i precedes i + 1.
    prompt = head + _prose_with_inserts(rng, hay, budget, chain) + tail
    return prompt, names, _fresh(rng, _name, len(names), prompt)


def _word_list(rng, budget, counts: dict[str, int], more: Callable[[], tuple[str, int]], sep: str):
    """Shuffle words by count, adding `more()` words while the list fits in the budget."""
    items = [w for w, c in counts.items() for _ in range(c)]
    if not all(budget.take(w, sep) for w in items):
        raise ValueError("context_length: too short for the word task")
    while True:
        word, count = more()
        if word in counts:
            continue
        if not all(budget.take(word, sep) for _ in range(count)):
            break
        counts[word] = count
        items += [word] * count
    rng.shuffle(items)
    return items


def _common_words(rng, hay, tok, n):
    n_common = 10 if n >= 2048 else 5
    common_words = rng.sample(hay.words, n_common)
    head = "Below is a list of words. Some of them appear more often than others.\n"
    tail = f"\nQuestion: What are the {n_common} most common words in the list above?\nAnswer: The {n_common} most common words are:"
    budget = _Budget(tok, n, head + tail, common_words)
    fit = budget.left // len(tok.encode("abcdefg, "))  # words that fit, roughly
    common = max(3, fit // (3 * n_common))  # common words take about a third of the list
    items = _word_list(
        rng,
        budget,
        {w: common for w in common_words},
        lambda: (rng.choice(hay.words), max(1, common // 3)),
        ", ",
    )
    counts = collections.Counter(items)
    by_first = lambda words: sorted(words, key=items.index)  # noqa: E731
    rare = by_first(w for w in counts if counts[w] < common)[:n_common]
    return head + ", ".join(items) + "." + tail, by_first(common_words), rare


def _frequent_words(rng, hay, tok, n, *, top=3):
    code = lambda: "".join(rng.choices(string.ascii_lowercase, k=5))  # noqa: E731
    head = "Read the following coded text and track how often each coded word appears.\n"
    tail = f"\nQuestion: What are the {top} most frequently appearing coded words in the text above?\nAnswer: The {top} most frequent coded words are:"
    budget = _Budget(tok, n, head + tail, ["xxxxx"] * top)
    a = max(4 * top, (budget.left // len(tok.encode(" xxxxx"))) // 6)  # ~ sum_r a/r over the words
    counts = {}
    while len(counts) < top + 1:
        counts.setdefault(code(), a // (len(counts) + 1))
    rank = [len(counts)]

    def more():
        rank[0] += 1
        return code(), max(1, a // rank[0])

    items = _word_list(rng, budget, counts, more, " ")
    ranked = sorted(counts, key=counts.__getitem__, reverse=True)
    return head + " ".join(items) + tail, ranked[:top], ranked[-top:]


_BUILDERS = {
    "niah_single": lambda r, h, t, n: _niah(r, h, t, n, n_keys=1, n_values=1, n_queries=1),
    "niah_multikey": lambda r, h, t, n: _niah(r, h, t, n, n_keys=4, n_values=1, n_queries=1),
    "niah_multivalue": lambda r, h, t, n: _niah(r, h, t, n, n_keys=1, n_values=4, n_queries=1),
    "niah_multiquery": lambda r, h, t, n: _niah(r, h, t, n, n_keys=4, n_values=1, n_queries=4),
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
    "frequent_words": _frequent_words,
}


def generate(
    task: str,
    context_length: int,
    n_examples: int,
    *,
    haystack: Haystack,
    tokenizer: Tokenizer,
    seed: int = 0,
) -> list[RulerExample]:
    """`n_examples` instances of `task`, each fitting in `context_length` tokens with its answer.

    Deterministic in (`task`, `context_length`, `seed`): every arm sees the same prompts.
    """
    if task not in _BUILDERS:
        raise ValueError(f"task: {task!r} is not one of {TASKS}")
    if context_length < 64:
        raise ValueError(f"context_length: need >= 64 tokens, got {context_length}")
    rng = random.Random(f"{task}/{context_length}/{seed}")
    out = []
    for _ in range(n_examples):
        prompt, answers, distractors = _BUILDERS[task](rng, haystack, tokenizer, context_length)
        example = RulerExample(task, context_length, prompt, tuple(answers), tuple(distractors))
        used = len(tokenizer.encode(prompt + example.target))
        if used > context_length:  # a tokenizer that merges across the pieces we counted
            raise ValueError(
                f"context_length: {task} example needs {used} > {context_length} tokens"
            )
        out.append(example)
    return out
