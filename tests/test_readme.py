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
    pre = {
        k.strip(): float(re.search(r"pre-cast ([0-9.e+-]+)", v).group(1)) for k, v in lines.items()
    }
    assert set(pre) == {"matched", "do_matched", "stale"}
    assert pre["matched"] < 1e-6 < pre["stale"]
    assert pre["matched"] < pre["do_matched"] < pre["stale"]
    # The output the README shows is what the example prints now (FP32 rounding-level values
    # by magnitude only; the rest to about two significant digits).
    shown = re.search(r"It prints[^\n]*\n\n```\n(.*?)```", text, re.S).group(1)
    numbers = lambda s: [float(x) for x in re.findall(r"[0-9]+\.[0-9]+(?:e[+-][0-9]+)?", s)]  # noqa: E731
    got, want = numbers(out.getvalue()), numbers(shown)
    assert len(got) == len(want) == 9
    for i, (g, w) in enumerate(zip(got, want)):
        if i == 1:  # matched, pre-cast
            assert g < 1e-6 and w < 1e-6
        else:
            assert abs(g - w) <= 0.06 * max(abs(g), abs(w)), (i, g, w)


def test_readme_names_the_two_setup_commands():
    text = README.read_text()
    assert "python -m train" in text
    assert "python -m pytest" in text


def test_readme_flax_example_runs():
    text = README.read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "MultiHeadAttention" in b
    )
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["y"].shape == (2, 256, 512)
