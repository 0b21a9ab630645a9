"""One code style for the tree: `ruff format --check` (settings in pyproject.toml: 4-space
indents, lines of 100) must find nothing to change."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_tree_is_formatted_with_ruff():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    unformatted = result.stdout.strip()
    assert result.returncode == 0, (
        f"ruff format --check found files to reformat (run `ruff format .`):\n{unformatted}"
        f"\n{result.stderr}"
    )
