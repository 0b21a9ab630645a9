"""One code style for the tree: `ruff format --check` (settings in pyproject.toml: 4-space
indents, lines of 100) must find nothing to change, and `ruff check` (pyflakes and the
syntax-level pycodestyle rules: unused imports and names, undefined names) nothing to fix."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "."], cwd=REPO, capture_output=True, text=True
    )


def test_tree_is_formatted_with_ruff():
    result = _ruff("format", "--check")
    unformatted = result.stdout.strip()
    assert result.returncode == 0, (
        f"ruff format --check found files to reformat (run `ruff format .`):\n{unformatted}"
        f"\n{result.stderr}"
    )


def test_tree_passes_ruff_check():
    result = _ruff("check", "--no-cache")
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}\n{result.stderr}"
