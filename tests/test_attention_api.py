"""Bad input to the public op gets a ValueError naming the argument; edge cases of sizes,
scales and backends get a result or an error that says what to change."""

import jax
import jax.numpy as jnp
import pytest

import dm_jax
from dm_jax.attention_op import MAX_SCALE
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


# --- edge cases: empty problems, extreme scales, malformed segment ids, the wrong host ---

EMPTY = {  # name: (q shape, k shape, v shape)
    "no_batch": ((0, 16, 4, 16), (0, 16, 2, 16), (0, 16, 2, 16)),
    "no_queries": ((1, 0, 4, 16), (1, 24, 2, 16), (1, 24, 2, 16)),
    "no_tokens": ((1, 0, 4, 16), (1, 0, 2, 16), (1, 0, 2, 16)),
    "no_keys": ((2, 16, 4, 16), (2, 0, 2, 16), (2, 0, 2, 16)),
    "no_query_heads": ((1, 16, 0, 16), (1, 16, 2, 16), (1, 16, 2, 16)),
    "no_value_dims": ((1, 16, 4, 16), (1, 16, 2, 16), (1, 16, 2, 0)),
}


@pytest.mark.parametrize("implementation", ["reference", "triton_interpret"])
@pytest.mark.parametrize("shapes", EMPTY.values(), ids=EMPTY.keys())
def test_empty_problems_give_zeros_as_jax_nn_does(shapes, implementation):
    """jax.nn.dot_product_attention returns an empty result for empty inputs and zeros when
    there is no key to attend to; so does dm_jax.attention, with zero gradients, under jit."""
    q, k, v = (jnp.ones(s, jnp.bfloat16) for s in shapes)

    def f(q, k, v):
        return dm_jax.attention(q, k, v, causal=True, implementation=implementation)

    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == jnp.bfloat16
    assert not jnp.any(out)
    grads = vjp(jnp.ones_like(out))
    assert [g.shape for g in grads] == list(shapes) and not any(jnp.any(g) for g in grads)
    res = row_sum_residuals(q, k, v, jnp.ones_like(out), implementation=implementation)
    assert res["pre_cast"].shape == (q.shape[0], q.shape[2], q.shape[1])


def test_sizes_that_cannot_form_heads_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"^k: expected a number of heads dividing q's 4 heads"):
        dm_jax.attention(Q, jnp.ones((1, 16, 0, 8)), jnp.ones((1, 16, 0, 8)))
    with pytest.raises(ValueError, match=r"^q: expected a head dim of at least 1"):
        dm_jax.attention(jnp.ones((1, 16, 4, 0)), jnp.ones((1, 16, 2, 0)), V)


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_scale_above_the_limit_is_rejected_and_the_limit_stays_finite(precision):
    with pytest.raises(ValueError, match=r"^scale: expected at most 65536: FP8 and bf16 flash"):
        dm_jax.attention(Q, K, V, scale=1e8, precision=precision)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    q, kk, v = (jax.random.normal(key, (1, 64, 2, 64)) for key in k)
    out, grads = jax.value_and_grad(
        lambda q: dm_jax.attention(q, kk, v, scale=MAX_SCALE, precision=precision).sum()
    )(q)
    assert jnp.isfinite(out) and jnp.all(jnp.isfinite(grads))


def test_segment_ids_of_three_arrays_are_rejected_by_name():
    ids = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"^segment_ids: expected an array \[B, T\] or a \(q_ids, kv_ids\) pair, got 3 items",
    ):
        dm_jax.attention(Q, K, V, segment_ids=(ids, ids, ids))


@pytest.mark.parametrize("implementation", ["pallas", "triton"])
def test_gpu_backends_on_a_cpu_name_the_argument_and_the_alternatives(monkeypatch, implementation):
    """Instead of Pallas' lowering error: the argument, why, and what this host runs."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(NotImplementedError) as err:
        dm_jax.attention(Q, K, V, implementation=implementation)
    message = str(err.value)
    assert message.startswith(f"implementation={implementation!r}: ")
    assert "needs a GPU (this host runs on cpu)" in message
    assert "implementations this host can run: 'reference', 'triton_interpret'" in message


def _lowered_lines(fn, *args) -> int:
    return len(jax.jit(fn).lower(*args).as_text().splitlines())


def test_layers_with_the_same_shapes_share_one_lowering():
    """Several attention calls of the same shapes and settings (an unscanned model's layers)
    lower their forward, their VJP and the kernels in them once and call them, instead of
    once per call: two more layers add only their call sites to the program (a Pallas
    kernel in interpret mode would add hundreds of lines per layer)."""
    q = jax.random.normal(jax.random.key(0), (1, 32, 2, 16), jnp.bfloat16)

    def layers(n):
        def fn(x):
            for _ in range(n):
                x = dm_jax.attention(x, x, x, causal=True, implementation="triton_interpret")
            return jnp.sum(x.astype(jnp.float32))

        return fn

    for transform in (lambda f: f, jax.grad):
        three = _lowered_lines(transform(layers(3)), q)
        five = _lowered_lines(transform(layers(5)), q)
        assert five - three < 0.02 * three, (three, five)
