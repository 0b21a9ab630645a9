"""The README's usage example runs and shows what it claims."""
import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matched_cancels():
    text = README.read_text()
    block = re.search(r"readme-example:start -->\s*```python\n(.*?)```", text, re.S).group(1)
    assert len(block.strip().splitlines()) <= 20
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    lines = dict(line.split(":", 1) for line in out.getvalue().strip().splitlines())
    pre = {k.strip(): float(re.search(r"pre-cast ([0-9.e+-]+)", v).group(1)) for k, v in lines.items()}
    assert set(pre) == {"matched", "do_matched", "stale"}
    assert pre["matched"] < 1e-6 < pre["stale"]
    assert pre["matched"] < pre["do_matched"] < pre["stale"]


def test_readme_names_the_two_setup_commands():
    text = README.read_text()
    assert "python -m train" in text
    assert "python -m pytest" in text
