"""The "pallas" chunk-local stage (`dm_jax.nn.chunk_local_pallas`, one Pallas kernel
forward and two backward) against XLA's stages of `recurrent_chunked`: the state pass's
operands, and end to end o, the final state and the gradients of q, k, v, the log decays
and beta, in Pallas interpret mode, for the delta and plain rules with packed documents, T
not a multiple of C, K and V padded, a given start state; its kernels lowered for CUDA at
gdn_gqa-569m's shape; its argument checks; the model flag reaching GDN and Mamba-2."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dm_jax.models import HybridLM, preset
from dm_jax.models.config import HybridConfig
from dm_jax.nn.chunk_local_pallas import pallas_chunk_local
from dm_jax.nn.recurrence import _chunk_local_xla, recurrent_chunked

JAX_011 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def _inputs(seed, B, T, H, K, V, doc_rate=0.03):
    """The mixers' inputs: L2-normalized q and k, Gaussian v, log decays in (-1, 0), sigmoid
    beta, packed documents (a boundary with probability doc_rate per token)."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((B, T, H, K)))
    k = unit(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    g = -np.exp(rng.uniform(-4, 0, (B, T, H, 1)))
    b = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    seg = np.cumsum(rng.uniform(size=(B, T)) < doc_rate, axis=1)
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, b)] + [jnp.asarray(seg)]


def _assert_close(got, want, name):
    scale = float(jnp.max(jnp.abs(want)))
    chex.assert_trees_all_close(got, want, atol=2e-6 * scale, rtol=1e-5, custom_message=name)


@pytest.mark.parametrize("delta_rule", [True, False], ids=["delta", "plain"])
def test_operands_match_xla_stages(delta_rule):
    """The six state-pass operands equal XLA's to f32 rounding (T a multiple of C)."""
    B, T, H, K, V, C = 2, 64, 2, 16, 32, 16
    q, k, v, g, b, seg = _inputs(0, B, T, H, K, V, doc_rate=0.08)
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    N = T // C
    want = _chunk_local_xla(q, k, v, g, b, seg, prev, C, N, "blocks", delta_rule)
    carried = seg.reshape(B, N, C) == prev[:, ::C][:, :, None]
    assert not bool(jnp.all(carried))  # some chunks start a document mid-way
    got = pallas_chunk_local(
        q, k, v, g[..., 0], b, seg, carried.reshape(B, T), chunk_size=C, delta_rule=delta_rule
    )
    for name, x, y in zip(("u_p", "w_p", "qg", "P", "k_end", "gam_end"), got, want):
        assert (x is None) == (y is None), name
        if y is not None:
            assert x.shape == y.shape, name
            _assert_close(x, y, name)


# name: (B, T, H, K, V, C, delta_rule, initial state)
CASES = {
    "delta_padded_T_and_V": (2, 100, 2, 32, 24, 32, True, False),
    "delta_padded_K_start_state": (1, 64, 3, 24, 16, 16, True, True),
    "plain_padded_T": (2, 72, 2, 16, 16, 16, False, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_recurrence_matches_xla_stages_with_gradients(case):
    """o, the final state and the gradients of all five inputs (and of the start state)
    under a random linear loss equal the XLA form's to f32 rounding."""
    B, T, H, K, V, C, delta_rule, with_state = case
    q, k, v, g, b, seg = _inputs(1, B, T, H, K, V)
    rng = np.random.default_rng(2)
    S0 = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32) if with_state else None
    w_o = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)

    def run(chunk_local):
        def loss(q, k, v, g, b, S0):
            o, S = recurrent_chunked(
                q, k, v, g, b, delta_rule=delta_rule, segment_ids=seg, chunk_size=C,
                initial_state_BHKV=S0, chunk_local=chunk_local,
            )  # fmt: skip
            return jnp.sum(o * w_o) + jnp.sum(S * w_s), (o, S)

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)
        return jax.jit(grad)(q, k, v, g, b, S0)

    (_, want), want_grads = run("xla")
    (_, got), got_grads = run("pallas")
    assert float(jnp.max(jnp.abs(want[0]))) > 0.5
    _assert_close(got[0], want[0], "o")
    _assert_close(got[1], want[1], "final state")
    for name, x, y in zip(("q", "k", "v", "log_decay", "beta", "S0"), got_grads, want_grads):
        if y is not None:
            assert float(jnp.max(jnp.abs(y))) > 0, name  # every input's gradient is live
            _assert_close(x, y, "d" + name)


def test_bfloat16_inputs_give_gradients_in_their_dtype():
    q, k, v, g, b = (x.astype(jnp.bfloat16) for x in _inputs(3, 1, 32, 1, 16, 16)[:5])
    grads = jax.grad(
        lambda q, k, v: jnp.sum(
            recurrent_chunked(q, k, v, g, b, delta_rule=True, chunk_size=16, chunk_local="pallas")[
                0
            ]
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    assert all(d.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(d))) for d in grads)


@pytest.mark.skipif(
    JAX_011,
    reason=f"the Triton IR capture uses jax 0.10's private lowering; this is jax {jax.__version__}",
)
@pytest.mark.parametrize("delta_rule", [True, False], ids=["delta", "plain"])
def test_kernels_lower_to_triton_at_569m_shape(delta_rule):
    """Forward and both backward kernels lower for CUDA at gdn_gqa-569m's GDN shape (B 8,
    T 4096, H 8, C 64, K = V = 128): the forward's dots (K K^T, Q K^T, 18 for the inverse,
    two for U_p and W_p; the plain rule Q K^T alone), the backward's (3 in the pairs kernel;
    9 in the solve kernel, none for the plain rule), all in tf32."""
    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    B, T, H, K, V = 8, 4096, 8, 128, 128
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    ops = (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, V), f32(B, T, H), f32(B, T, H))
    ops += (jax.ShapeDtypeStruct((B, T), jnp.int32), f32(B, T))

    def loss(*ops):
        outs = pallas_chunk_local(*ops, chunk_size=64, delta_rule=delta_rule, interpret=False)
        return sum(jnp.sum(x) for x in outs if x is not None)

    modules = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *ops)
    dots = {name: m.count("tt.dot ") for name, m in modules.items()}
    want = {"forward": 22, "backward_pairs": 3, "backward_solve": 9}
    if not delta_rule:
        want = {"forward": 1, "backward_pairs": 3, "backward_solve": 0}
    assert dots == {f"dm_chunk_local_{k}": n for k, n in want.items()}
    for m in modules.values():
        assert m.count("inputPrecision = tf32") == m.count("tt.dot ")


def test_arguments_are_checked():
    q, k, v, g, b, _ = _inputs(0, 1, 40, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_local"):
        recurrent_chunked(q, k, v, g, b, delta_rule=True, chunk_local="triton")
    with pytest.raises(ValueError, match="C \\(chunk\\) must be a power of two"):
        recurrent_chunked(q, k, v, g, b, delta_rule=True, chunk_size=24, chunk_local="pallas")
    g_channels = jnp.broadcast_to(g, g.shape[:-1] + (16,))
    with pytest.raises(ValueError, match="one decay per head"):
        recurrent_chunked(
            q, k, v, g_channels, b, delta_rule=True, chunk_size=16, chunk_local="pallas"
        )
    with pytest.raises(ValueError, match="chunk_local"):
        HybridConfig(chunk_local="fast")


def test_config_chunk_local_reaches_gdn_and_mamba2_not_kda():
    """HybridConfig.chunk_local sets GDN's and Mamba-2's form; KDA (a per-channel decay)
    keeps XLA's."""
    want = {"GatedDeltaNet": "pallas", "Mamba2": "pallas", "KimiDeltaAttention": "xla"}
    for family in ("gdn_gqa", "mamba2_gqa", "kda_gqa"):
        model = HybridLM(preset(family, "tiny", chunk_local="pallas"), rngs=nnx.Rngs(0))
        forms = {
            type(m).__name__: m.chunk_local
            for _, m in nnx.iter_graph(model)
            if isinstance(m, nnx.Module) and hasattr(m, "chunk_local")
        }
        assert forms and all(want[kind] == form for kind, form in forms.items()), family


@pytest.mark.parametrize("chunk", [16, 64, 128])
def test_inverse_stays_accurate_for_keys_that_point_alike(chunk):
    """(I + A)^-1 with K K^T near 1 (trained keys often are): the series over A itself
    ((I - A)(I + A^2)...) loses everything to cancellation here; the kernels' blocked
    inverse stays at f32 rounding of the exact one."""
    from pallas_kernels.chunk_local.common import unit_lower_inverse

    rng = np.random.default_rng(chunk)
    k = 1.0 + 0.1 * rng.standard_normal((chunk, 64))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    A = np.tril(k @ k.T, -1) * 0.95
    exact = np.linalg.inv(np.eye(chunk) + A)
    dot = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    got = np.asarray(unit_lower_inverse(jnp.asarray(A, jnp.float32), dot))
    assert np.abs(got - exact).max() < 1e-4 * np.abs(exact).max()
    series = np.eye(chunk) - A  # the series over A, in f32 as a kernel would run it
    power = A.astype(np.float32)
    for _ in range(1, (chunk - 1).bit_length()):
        power = power @ power
        series = series + series @ power
    assert chunk == 16 or np.abs(series - exact).max() > 1.0  # what the blocks avoid
