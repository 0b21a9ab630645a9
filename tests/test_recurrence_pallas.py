"""The "pallas" state pass (one Pallas kernel per direction, `dm_jax.nn.recurrence_pallas`)
against the sequential `lax.scan` over chunks: outputs, final state and the gradients of
every chunk operand and of the start state, in Pallas interpret mode; its kernels lowered
for CUDA at gdn_gqa-569m's shape; its argument checks. (End to end, through
`recurrent_chunked` with packed documents and T not a multiple of C, the pass is one of the
state passes of tests/test_nn_recurrence.py.)"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dm_jax.nn.recurrence import sequential_state_pass
from dm_jax.nn.recurrence_pallas import pallas_state_pass
from pallas_kernels.linear_recurrence import forward
from pallas_kernels.linear_recurrence.common import ChunkSteps
from pallas_kernels.linear_recurrence.config import StatePassConfig

JAX_011 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def _operands(seed, N, B, H, C, K, V, G, plain):
    """Chunk operands of stable magnitudes: decays in (0, 1), |K_end^T W_p| well below 1.
    (numpy's generator: no XLA compile per shape.)"""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal((N, B, H) + shape), jnp.float32)
    S0 = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    u_p, qg, P, k_end = normal(C, V), normal(C, K), normal(C, C), normal(C, K)
    w_p = normal(C, K) * 0.3 / K
    gam_end = 1 / (1 + jnp.exp(normal(G, 1)))
    return S0, u_p, None if plain else w_p, qg, P, k_end, gam_end


def _assert_close(got, want, name):
    """Equal up to f32 rounding of sums whose terms reach max|want|: |got - want| <=
    1e-5 (|want| + max|want|)."""
    scale = float(jnp.max(jnp.abs(want)))
    chex.assert_trees_all_close(got, want, atol=1e-5 * scale, rtol=1e-5, custom_message=name)


# name: (N, B, H, C, K, V, G, plain, block_v). Kernel-sized dims with two V blocks; odd
# sizes (zero-padded to 16) with per-channel decays; V padded 40 -> 64 into four V blocks.
CASES = {
    "delta_per_head_two_v_blocks": (3, 2, 1, 16, 16, 32, 1, False, 16),
    "delta_per_channel_padded": (3, 1, 2, 8, 8, 6, 8, False, 64),
    "plain_per_channel_four_v_blocks": (2, 1, 2, 16, 32, 40, 32, True, 16),
    "plain_per_head_padded": (3, 2, 1, 5, 8, 6, 1, True, 64),
}


def _token_major(o_NBHCV):
    """[N, B, H, C, V] -> [B, N * C, H, V] (chunk n's row r is token n * C + r)."""
    N, B, H, C, V = o_NBHCV.shape
    return jnp.moveaxis(o_NBHCV, 0, 1).swapaxes(2, 3).reshape(B, N * C, H, V)


@pytest.mark.parametrize("token_major", [True, False], ids=["token_major", "chunk_layout"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_pallas_pass_matches_sequential_scan(case, token_major):
    """Outputs, final state and the gradients of all seven inputs (start state included)
    under random cotangents equal the scan's to f32 rounding, for the delta and plain rules,
    per-head and per-channel decays, one to four V blocks, padded and kernel-sized dims, with
    the outputs (and their cotangents) token-major or in the chunk layout."""
    *dims, G, plain, block_v = case
    N, B, H, C, K, V = dims
    ops = _operands(0, N, B, H, C, K, V, G, plain)
    rng = np.random.default_rng(1)
    w_o = jnp.asarray(rng.standard_normal((N, B, H, C, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    config = StatePassConfig(block_v=block_v, token_major_outputs=token_major)

    layout = _token_major if token_major else (lambda o: o)

    def run(state_pass):
        def loss(ops):
            o, S = state_pass(*ops)
            return jnp.sum(o * layout(w_o)) + jnp.sum(S * w_s), (o, S)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(ops)

    (_, want), want_grads = run(lambda *ops: _with_layout(sequential_state_pass(*ops), layout))
    (_, got), got_grads = run(lambda *ops: pallas_state_pass(*ops, config=config))
    assert got[0].shape == layout(w_o).shape
    assert float(jnp.max(jnp.abs(want[0]))) > 1.0  # the outputs carry the state
    _assert_close(got[0], want[0], "o")
    _assert_close(got[1], want[1], "final state")
    assert (got_grads[2] is None) == plain
    names = ("S0", "u_p", "w_p", "qg", "P", "k_end", "gam_end")
    for name, g, w in zip(names, got_grads, want_grads):
        if w is not None:
            _assert_close(g, w, "d" + name)


def _with_layout(o_and_S, layout):
    o, S = o_and_S
    return layout(o), S


@pytest.mark.skipif(
    JAX_011,
    reason=f"the Triton IR capture uses jax 0.10's private lowering; this is jax {jax.__version__}",
)
@pytest.mark.parametrize("plain", [False, True], ids=["delta", "plain"])
def test_kernels_lower_to_triton_at_569m_shape(plain):
    """Forward and backward lower for CUDA (Triton blocks legal) at gdn_gqa-569m's GDN shape
    (N 64, B 8, H 8, C 64, K = V = 128), one launch each: 4 dots forward and 4 backward for
    the delta rule (3 and 3 for the plain rule), all in tf32 unless asked for ieee; with the
    outputs token-major (the default) and in the chunk layout."""
    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    N, B, H, C, K, V = 64, 8, 8, 64, 128, 128
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    ops = (f32(B, H, K, V), f32(N, B, H, C, V), None if plain else f32(N, B, H, C, K))
    ops += (f32(N, B, H, C, K), f32(N, B, H, C, C), f32(N, B, H, C, K), f32(N, B, H, 1, 1))
    for precision, token_major in (("tf32", True), ("ieee", True), ("tf32", False)):
        config = StatePassConfig(dot_precision=precision, token_major_outputs=token_major)

        def loss(*ops):
            o, S = pallas_state_pass(*ops, config=config, interpret=False)
            return jnp.sum(o) + jnp.sum(S)

        args = [i for i, x in enumerate(ops) if x is not None]
        modules = lower_for_cuda(jax.grad(loss, argnums=args), *ops)
        assert sorted(modules) == ["dm_linear_recurrence_backward", "dm_linear_recurrence_forward"]
        dots = {name.split("_")[-1]: m.count("tt.dot ") for name, m in modules.items()}
        assert dots == ({"forward": 3, "backward": 3} if plain else {"forward": 4, "backward": 4})
        for m in modules.values():  # ieee is tt.dot's default, printed as no attribute
            want = m.count("tt.dot ") if precision == "tf32" else 0
            assert m.count("inputPrecision = tf32") == want and "inputPrecision = tf32x3" not in m


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        StatePassConfig(block_v=48)
    with pytest.raises(ValueError, match="backward_warps"):
        StatePassConfig(backward_warps=6)
    with pytest.raises(ValueError, match="dot_precision"):
        StatePassConfig(dot_precision="bf16")
    for dims, match in (
        ((2, 1, 1, 16, 24, 16), r"K \(key dim\) must be a power of two >= 16, got 24"),
        ((1, 1, 1, 256, 16, 16), r"C \(chunk\) must be at most 128"),  # compiled only
    ):
        S0, u_p, w_p, qg, P, k_end, gam_end = _operands(0, *dims, 1, False)
        gam_NBHK = jnp.broadcast_to(gam_end[..., 0], k_end.shape[:3] + (dims[4],))
        steps = ChunkSteps(u_p, w_p, qg, P, k_end, gam_NBHK)
        with pytest.raises(ValueError, match=match):
            forward.forward(S0, steps, config=StatePassConfig(), store_states=False)


def test_pallas_is_a_state_pass_of_the_model_and_the_trainer():
    from dm_jax.models import HybridConfig
    from train import config as config_lib

    assert HybridConfig(state_pass="pallas").state_pass == "pallas"
    args = config_lib.parse_args(["--run-dir", "x", "--state-pass", "pallas"])
    assert dict(args.model.overrides)["state_pass"] == "pallas"


def test_auto_picks_pallas_only_on_a_gpu_and_where_the_kernels_take_the_shapes(monkeypatch):
    from dm_jax.models import HybridConfig
    from dm_jax.nn import recurrence

    assert HybridConfig().state_pass == "auto"
    assert recurrence.resolve_state_pass("auto", 64, 128, 128) == "sequential"  # a CPU
    assert recurrence.resolve_state_pass("associative", 64, 128, 128) == "associative"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert recurrence.resolve_state_pass("auto", 64, 128, 64) == "pallas"
    assert recurrence.resolve_state_pass("auto", 32, 16, 16) == "pallas"
    for c, k, v in ((256, 128, 128), (64, 8, 8), (64, 96, 128)):  # shared memory; blocks
        assert recurrence.resolve_state_pass("auto", c, k, v) == "sequential"
    assert recurrence.resolve_state_pass("sequential", 64, 128, 128) == "sequential"


def test_the_model_config_names_the_state_pass_each_mixer_runs(monkeypatch):
    from dm_jax.models import preset

    assert preset("gdn_gqa", "small").state_passes(2048) == {"gdn": "sequential"}  # a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert preset("mamba2_gqa", "569m").state_passes(4096) == {"mamba2": "pallas"}
    assert preset("kda_gqa", "small").state_passes(4096) == {"kda": "pallas"}
    assert preset("gdn_gqa", "small", chunk_size=256).state_passes(4096) == {"gdn": "sequential"}
    assert preset("gdn_gqa", "small", chunk_size=256).state_passes(128) == {"gdn": "pallas"}
    assert preset("gdn_gqa", "small", mixer_impl="naive").state_passes(4096) == {}
    assert preset("gqa", "small").state_passes(4096) == {}


def test_layers_with_the_same_shapes_share_one_lowering():
    """The state pass of several layers with the same shapes lowers its kernels once (as
    an unscanned model's layers call it): two more calls add only their call sites."""
    S0, *ops = _operands(0, 2, 1, 1, 16, 16, 16, 1, False)

    def layers(n):
        def fn(S):
            for _ in range(n):
                o, S = pallas_state_pass(S, *ops)
            return jnp.sum(o) + jnp.sum(S)

        return fn

    for transform in (lambda f: f, jax.grad):
        lines = [
            len(jax.jit(transform(layers(n))).lower(S0).as_text().splitlines()) for n in (3, 5)
        ]
        assert lines[1] - lines[0] < 0.02 * lines[0], lines
