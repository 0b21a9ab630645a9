"""Bad input to the public op gets a ValueError naming the argument."""

import jax.numpy as jnp
import pytest

import dm_jax
from dm_jax.diagnostics import gain_statistics, row_sum_residuals

Q = jnp.ones((1, 16, 4, 8))
K = jnp.ones((1, 16, 2, 8))
V = jnp.ones((1, 16, 2, 8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q=jnp.ones((16, 4, 8))), r"^q: expected a rank-4 array"),
        (dict(k=jnp.ones((1, 16, 2, 4))), r"^k: expected head dim 8"),
        (dict(k=jnp.ones((1, 16, 3, 8)), v=jnp.ones((1, 16, 3, 8))), r"^k: .*dividing q's 4 heads"),
        (dict(v=jnp.ones((1, 15, 2, 8))), r"^v: expected the tokens and heads of k"),
        (dict(k=jnp.ones((2, 16, 2, 8))), r"^k, v: expected batch size 1"),
        (dict(q=jnp.ones((1, 16, 4, 8), jnp.int32)), r"^q: expected a floating-point dtype"),
        (dict(delta="exact"), r"^delta: expected one of \('matched', 'do_matched', 'stale'\)"),
        (dict(precision="fp16"), r"^precision: expected one of \('fp8', 'bf16'\)"),
        (dict(implementation="cuda"), r"^implementation: expected None or one of"),
        (dict(scale=-1.0), r"^scale: expected a positive finite"),
        (
            dict(segment_ids=jnp.zeros((1, 15), jnp.int32)),
            r"^q segment_ids: expected shape \(1, 16\)",
        ),
        (
            dict(
                k=jnp.ones((1, 8, 2, 8)),
                v=jnp.ones((1, 8, 2, 8)),
                segment_ids=jnp.zeros((1, 16), jnp.int32),
            ),
            r"^segment_ids: expected a \(q_ids \[B, 16\], kv_ids \[B, 8\]\) pair",
        ),
        (
            dict(segment_ids=(jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 9), jnp.int32))),
            r"^kv segment_ids: expected shape \(1, 16\)",
        ),
        (
            dict(segment_ids=jnp.zeros((1, 16), jnp.float32)),
            r"^segment_ids: expected an integer dtype",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, match):
    args = dict(q=Q, k=K, v=V)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        dm_jax.attention(q, k, v, **args)


def test_row_sum_residuals_checks_do_shape():
    with pytest.raises(ValueError, match=r"^do: expected shape"):
        row_sum_residuals(Q, K, V, jnp.ones((1, 16, 4, 7)))


def test_gain_statistics_shares():
    g_q = jnp.array([1.0, 1.0, 3.0, 1.0, 1.0])
    g_k = jnp.array([1.0, 2.0, 1.0, 1.0, 1.0])
    stats = gain_statistics(g_q, g_k)
    energy = jnp.array([1.0, 4.0, 9.0, 1.0, 1.0])
    assert float(stats["max_gain"]) == 3.0
    assert abs(float(stats["top1_share"]) - 9 / 16) < 1e-6
    assert abs(float(stats["top4_share"]) - 15 / 16) < 1e-6
    assert int(stats["top_channels"][0]) == 2
    assert float(jnp.sum(energy)) == 16.0
    with pytest.raises(ValueError, match="g_q, g_k"):
        gain_statistics(jnp.ones(4), jnp.ones(5))


def test_kernel_modules_import_first():
    """Each module of the kernel side can be the first import (no import cycle)."""
    import pathlib
    import subprocess
    import sys

    code = (
        "from pallas_kernels.fp8_attention.triton.config import TritonConfig; TritonConfig()\n"
        "from pallas_kernels.fp8_attention.tiles import NumericsTiles; NumericsTiles()\n"
    )
    repo = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(repo))
