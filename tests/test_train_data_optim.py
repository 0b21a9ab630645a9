"""Data (built-in text, user files, token files, packing, split, order) and optimizers."""

import base64
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from test_train_standin import StandinLM
from train import config as config_lib
from train import data as data_lib
from train import optim


def _cfg(**kw):
    return config_lib.DataConfig(**{"max_builtin_bytes": 300_000, **kw})


def test_builtin_data_split_is_deterministic_and_disjoint():
    a, b = data_lib.load_splits(_cfg()), data_lib.load_splits(_cfg())
    assert len(a.train) > 100_000 and len(a.val) > 0
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.vocab_size == 257 and a.train.max() <= 256 and (a.train == a.eos_id).sum() >= 2
    text = data_lib.ByteTokenizer().decode(a.train[:2000])
    assert "import" in text or "def " in text  # real Python source


def test_packing_segments_and_mask():
    eos = 9
    window = np.array([[1, 2, eos, 3, 4, eos, 5, 6, 7]])
    seg, mask = data_lib.segments_and_mask(window, eos, "segments")
    np.testing.assert_array_equal(seg, [[1, 1, 1, 2, 2, 2, 3, 3]])
    np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 1, 0, 1, 1]])  # no target across documents
    seg, mask = data_lib.segments_and_mask(window, eos, "concat")
    assert (seg == 1).all() and (mask == 1).all()


def test_batches_are_a_pure_function_of_seed_and_index():
    tokens = np.arange(10_000, dtype=np.int32)
    mk = lambda seed: data_lib.Batches(
        tokens,
        batch_size=4,
        seq_len=16,
        seed=seed,
        eos_id=None,  # noqa: E731
        packing="segments",
    )
    b1, b2 = mk(0).batch(7), mk(0).batch(7)
    np.testing.assert_array_equal(b1["tokens"], b2["tokens"])
    np.testing.assert_array_equal(b1["targets"][:, :-1], b1["tokens"][:, 1:])
    assert not np.array_equal(mk(1).batch(7)["tokens"], b1["tokens"])
    # Two hosts' shards make up the global batch.
    halves = [mk(0).batch(7, shard=i, num_shards=2)["tokens"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), b1["tokens"])
    # One epoch visits every window once.
    n = mk(0).num_windows
    seen = np.concatenate([mk(0).batch(i)["tokens"][:, 0] for i in range(n // 4)])
    assert len(set(seen.tolist())) == len(seen)


def test_text_directory_and_token_files(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(30):
        (tmp_path / "docs" / f"d{i}.txt").write_text(f"document {i} " * 50)
    s = data_lib.load_splits(_cfg(source=str(tmp_path / "docs"), val_fraction=0.2))
    assert len(s.train) > len(s.val) > 0
    tokens = np.random.default_rng(0).integers(0, 1000, 50_000).astype(np.uint16)
    tokens.tofile(tmp_path / "tok.bin")
    np.save(tmp_path / "tok.npy", tokens.astype(np.int32))
    for name in ("tok.bin", "tok.npy"):
        cfg = _cfg(source=str(tmp_path / name), eos_id=0)
        s = data_lib.load_splits(cfg)
        assert len(s.train) + len(s.val) == 50_000 and s.vocab_size == tokens.max() + 1
        assert data_lib.vocab_size(cfg) == 1024
    assert isinstance(data_lib._load_token_file(_cfg(source=str(tmp_path / "tok.bin"))), np.memmap)


def test_tiktoken_from_local_ranks_file(tmp_path):
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    tok = data_lib.make_tokenizer(_cfg(tokenizer="tiktoken", tiktoken_encoding=str(ranks)))
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world" and tok.vocab_size == 257


def _jit_first_update(tx):
    """(grads, params) -> tx's first update, under jit: run op by op, Muon's Newton-Schulz
    iterations take seconds per call (each eager call traces them again)."""
    return jax.jit(lambda grads, params: tx.update(grads, tx.init(params), params)[0])


def test_muon_routes_hidden_matrices_by_structure():
    model = StandinLM(257, d=32, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = optim.hidden_matrix_mask(model, params, 257)
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    hidden = sorted(k for k, m in flat.items() if m)
    assert hidden and all(
        "kernel" in k and ("qkv" in k or "out" in k or "up" in k or "down" in k) for k in hidden
    )
    assert not any(
        m for k, m in flat.items() if "embed" in k or "head" in k or "scale" in k or "bias" in k
    )

    cfg = config_lib.OptimizerConfig(
        name="muon", learning_rate=0.02, warmup_steps=0, weight_decay=0.0
    )
    tx = cfg.build(10, mask)
    grads = jax.tree.map(jnp.ones_like, params)
    updates = _jit_first_update(tx)(grads, params)
    up = {jax.tree_util.keystr(p): u for p, u in jax.tree_util.tree_leaves_with_path(updates)}
    key = next(k for k in hidden if "qkv" in k)
    # Muon orthogonalizes the all-ones gradient (rank 1): a rank-1 update; AdamW's is elementwise.
    assert np.linalg.matrix_rank(np.asarray(up[key]), tol=1e-3) == 1
    emb = next(k for k in up if "embed" in k)
    np.testing.assert_allclose(np.abs(np.asarray(up[emb])), 0.02, rtol=1e-3)


def test_schedule_and_clipping():
    cfg = config_lib.OptimizerConfig(
        learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1, clip_norm=0.5
    )
    sched = optim.schedule(cfg, 100, 1.0)
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.1)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm))
    g = {"w": jnp.full((4,), 10.0)}
    out, _ = tx.update(g, tx.init(g))
    assert float(optax.global_norm(out)) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("at", [1, 5, 60, 100])  # in warmup, at its end, mid-decay, after the end
def test_schedule_extension_is_continuous(at):
    cfg = config_lib.OptimizerConfig(learning_rate=1.0, warmup_steps=5, min_lr_ratio=0.1)
    before = optim.schedule(cfg, 100, 1.0)
    after = optim.schedule(cfg, 200, 1.0, extensions=((at, 100),))
    for s in range(at + 1):  # the steps already taken keep their rates
        assert float(after(s)) == pytest.approx(float(before(s)), rel=1e-6), s
    rates = np.array([float(after(s)) for s in range(at, 201)])
    assert rates[-1] == pytest.approx(0.1, rel=1e-5)  # the floor at the new total
    past_peak = rates[max(0, 5 - at) :]
    assert np.all(np.diff(past_peak) <= 1e-7)  # decays from there, never jumps back up
    assert np.max(np.abs(np.diff(rates))) <= 0.21  # no jump bigger than a warmup step (0.2)
    # A second extension continues from the first one's curve.
    again = optim.schedule(cfg, 300, 1.0, extensions=((at, 100), (150, 200)))
    assert float(again(150)) == pytest.approx(float(after(150)), rel=1e-6)
    assert float(again(300)) == pytest.approx(0.1, rel=1e-5) and float(again(151)) <= float(
        again(150)
    )


def test_small_text_folder_splits_by_tokens(tmp_path):
    """A few files, none of which hashes into validation: the stream's tail is validation."""
    names = [f"notes{i}.txt" for i in range(7)]
    assert not any(data_lib._is_validation(n, 0.02) for n in names)  # the case being tested
    for i, n in enumerate(names):
        (tmp_path / n).write_text(f"note {i}: " + "lorem ipsum dolor sit amet " * 500)
    s = data_lib.load_splits(_cfg(source=str(tmp_path)))
    total = len(s.train) + len(s.val)
    assert len(s.val) == int(total * 0.02) and "last 2%" in s.description
    assert total == sum(len(open(tmp_path / n, "rb").read()) + 1 for n in names)  # nothing lost
    run = config_lib.parse_args(["--data", str(tmp_path), "--run-dir", str(tmp_path / "run")])
    train, val = data_lib.make_batches(run, s)  # the default tiny batch fits both splits
    assert val.batch(0)["tokens"].shape == (8, 128) and train.num_windows > val.num_windows


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_qk_gain_learning_rate_and_no_gain_decay(name):
    """The QK-norm gains (found by the attention layer that owns them) take
    `qk_gain_lr_ratio` x the AdamW step; no gain is weight-decayed."""
    from dm_jax import models

    model = models.HybridLM(models.preset("gdn_gqa", "tiny"), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    gains = optim.qk_gain_mask(model, params)
    marked = {jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(gains) if m}
    n_attention = len(models.qk_gains(model))
    assert len(marked) == 2 * n_attention and n_attention >= 1
    assert all("scale" in k and ("q_norm" in k or "k_norm" in k) for k in marked)

    hidden = optim.hidden_matrix_mask(model, params, model.config.vocab_size)

    @functools.cache
    def update_fn(ratio):  # one compile per ratio; the gradients are an argument
        cfg = config_lib.OptimizerConfig(
            name=name, learning_rate=0.01, warmup_steps=0, weight_decay=0.5, qk_gain_lr_ratio=ratio
        )
        return _jit_first_update(cfg.build(10, hidden, qk_gain_mask=gains))

    def first_update(ratio, grad_value):
        grads = jax.tree.map(lambda x: jnp.full_like(x, grad_value), params)
        updates = update_fn(ratio)(grads, params)
        return {jax.tree_util.keystr(p): u for p, u in jax.tree_util.tree_leaves_with_path(updates)}

    plain, raised = first_update(1.0, 1.0), first_update(7.0, 1.0)
    for key in plain:
        want = 7.0 if key in marked else 1.0
        np.testing.assert_allclose(
            np.asarray(raised[key]), want * np.asarray(plain[key]), rtol=1e-5
        )
    # Zero gradients: only weight decay moves a parameter; it never reaches a gain.
    decay_only = first_update(7.0, 0.0)
    vectors = {k for k, u in decay_only.items() if np.ndim(u) <= 1}  # gains, biases, scalars
    assert marked <= vectors
    assert all(not np.any(np.asarray(decay_only[k])) for k in vectors)
    assert any(np.any(np.asarray(u)) for u in decay_only.values())  # the matrices do decay

    no_norm = models.HybridLM(models.preset("gdn_gqa", "tiny", qk_norm=False), rngs=nnx.Rngs(0))
    no_params = nnx.state(no_norm, nnx.Param)
    cfg = config_lib.OptimizerConfig(name=name, qk_gain_lr_ratio=3.0)
    with pytest.raises(ValueError, match="qk-gain-lr-ratio"):
        cfg.build(
            10,
            jax.tree.map(lambda _: False, no_params),
            qk_gain_mask=optim.qk_gain_mask(no_norm, no_params),
        )
    with pytest.raises(ValueError, match="qk-gain-lr-ratio"):
        config_lib.OptimizerConfig(qk_gain_lr_ratio=0.0).validate()
