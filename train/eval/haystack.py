"""Offline haystack text for the long-context suite.

The suite never downloads anything: the haystack is the prose of the built-in training data
(docstrings of the Python standard library sources, `train.data.builtin_files()`), split
into sentences, plus a word list drawn from it for keys and word tasks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_WORD_RE = re.compile(r"\b[a-z]{4,9}\b")


@dataclasses.dataclass(frozen=True)
class Haystack:
    """Sentences of filler prose and a vocabulary of plain lower-case words from it."""

    sentences: tuple[str, ...]
    words: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def builtin_prose(min_chars: int = 200) -> str:
    """Docstrings (>= `min_chars` long) of the built-in data's files, blank-line separated."""
    from train.data import builtin_files

    parts = []
    for path in builtin_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                tree = ast.parse(f.read())
            except SyntaxError:
                continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    parts.append(doc)
    return "\n\n".join(parts)


def build_haystack(text: str | None = None, *, min_words: int = 400) -> Haystack:
    """Split `text` (default: `builtin_prose()`) into prose sentences and a word vocabulary.

    Sentences keep only lines that read as prose (no code, no tables); numbers are removed
    so that the only numbers in a haystack are the needles' values.
    """
    text = builtin_prose() if text is None else text
    prose = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.splitlines()]
        if not lines or any(line.startswith((">>>", "...", "|", "=", "-", "*")) for line in lines):
            continue
        prose.append(" ".join(lines))
    sentences = []
    for paragraph in prose:
        for sentence in _SENTENCE_RE.split(paragraph):
            sentence = re.sub(r"\d", "", sentence).strip()
            if 40 <= len(sentence) <= 300 and sentence.isascii() and sentence[-1] in ".!?":
                sentences.append(sentence)
    words = sorted(set(_WORD_RE.findall(" ".join(sentences).lower())))
    if len(sentences) < 20 or len(words) < min_words:
        raise ValueError(
            f"text: need >= 20 prose sentences and >= {min_words} distinct words, "
            f"got {len(sentences)} sentences and {len(words)} words"
        )
    return Haystack(sentences=tuple(sentences), words=tuple(words))
