"""A tiny transformer that stands in for dm_jax.models in trainer tests, and its own test.

It has what the trainer touches: embedding (plus fixed sinusoidal positions), attention through
dm_jax.attention with QK RMSNorm gains, MLP, LM head, `qk_gains` and `attention_probe`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dm_jax
from dm_jax import diagnostics
from train import config as config_lib
from train import model as model_lib


class Block(nnx.Module):
    def __init__(self, d, heads, *, rngs):
        self.heads, self.hd = heads, d // heads
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.q_norm, self.k_norm = nnx.RMSNorm(self.hd, rngs=rngs), nnx.RMSNorm(self.hd, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def qkv_BTHD(self, x_BTD):
        B, T, _ = x_BTD.shape
        q, k, v = jnp.split(
            self.qkv(self.norm1(x_BTD)).reshape(B, T, 3 * self.heads, self.hd), 3, axis=2
        )
        return self.q_norm(q), self.k_norm(k), v

    def __call__(self, x_BTD, segment_ids, attention, tap_BTHD=None):
        q, k, v = self.qkv_BTHD(x_BTD)
        o_BTHD = attention(q, k, v, segment_ids)
        if tap_BTHD is not None:
            o_BTHD = o_BTHD + tap_BTHD
        x_BTD = x_BTD + self.out(o_BTHD.reshape(x_BTD.shape))
        return x_BTD + self.down(jax.nn.gelu(self.up(self.norm2(x_BTD))))


class StandinLM(nnx.Module):
    def __init__(self, vocab, d=32, heads=2, layers=2, arm="matched", *, rngs):
        self.arm = arm
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def attention(self, q, k, v, segment_ids):
        delta = self.arm if self.arm in ("matched", "do_matched", "stale") else "matched"
        precision = "bf16" if self.arm in ("bf16", "reference") else "fp8"
        return dm_jax.attention(
            q,
            k,
            v,
            causal=True,
            delta=delta,
            precision=precision,
            segment_ids=segment_ids,
            implementation="reference",
        )

    def inputs(self, tokens_BT):
        """Token embeddings plus fixed sinusoidal positions (a position-blind model would give
        runs of identical tokens identical q, k, v: rows whose dS vanishes exactly)."""
        x_BTD = self.embed(tokens_BT)
        T, D = x_BTD.shape[1:]
        angle_TD = jnp.arange(T)[:, None] / 10_000 ** (jnp.arange(D)[None, :] // 2 * 2 / D)
        return x_BTD + jnp.where(jnp.arange(D) % 2 == 0, jnp.sin(angle_TD), jnp.cos(angle_TD))

    def __call__(self, tokens_BT, *, segment_ids=None, taps=None):
        x = self.inputs(tokens_BT)
        for i, block in enumerate(self.blocks):
            x = block(x, segment_ids, self.attention, None if taps is None else taps[i])
        return self.head(self.norm(x)).astype(jnp.float32)


def standin_build(run_config):
    o = dict(run_config.model.overrides)
    return StandinLM(
        o["vocab_size"], arm=o.get("attention", "matched"), rngs=nnx.Rngs(run_config.seed)
    )


def standin_qk_gains(model):
    return {i: (b.q_norm.scale.value, b.k_norm.scale.value) for i, b in enumerate(model.blocks)}


def standin_probe(model, tokens_BT, targets_BT, *, segment_ids=None):
    """q, k, v of every attention layer and the loss gradient at its output (dO)."""
    x = model.inputs(tokens_BT)
    qkvs = []
    for block in model.blocks:
        qkvs.append(block.qkv_BTHD(x))
        x = block(x, segment_ids, model.attention)
    taps = [jnp.zeros_like(v) for _, _, v in qkvs]

    def loss(taps):
        logits = model(tokens_BT, segment_ids=segment_ids, taps=taps)
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BT[..., None], -1))

    dos = jax.grad(loss)(taps)
    return {i: dict(q=q, k=k, v=v, do=do) for i, ((q, k, v), do) in enumerate(zip(qkvs, dos))}


HOOKS = model_lib.ModelHooks(
    build=standin_build,
    qk_gains=standin_qk_gains,
    attention_probe=standin_probe,
    gain_statistics=diagnostics.gain_statistics,
    row_sum_residuals=diagnostics.row_sum_residuals,
)


def tiny_config(run_dir, **kw):
    """A RunConfig for the stand-in: seconds per run on a CPU."""
    arm = kw.pop("attention", "matched")
    data = kw.pop("data", config_lib.DataConfig(max_builtin_bytes=400_000))
    model = config_lib.ModelSpec("standin", "tiny", (("attention", arm), ("vocab_size", 257)))
    base = dict(
        model=model,
        data=data,
        run_dir=str(run_dir),
        steps=6,
        batch_size=4,
        seq_len=32,
        log_every=2,
        eval_every=3,
        eval_batches=1,
        probe_every=3,
        ckpt_every=3,
        optimizer=config_lib.OptimizerConfig(warmup_steps=2),
    )
    base.update(kw)
    return config_lib.RunConfig(**base)


def test_standin_probe_gives_do_of_every_layer():
    model = StandinLM(257, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    probes = standin_probe(model, tokens, tokens)
    assert sorted(probes) == [0, 1]
    assert probes[1]["do"].shape == probes[1]["q"].shape == (2, 16, 2, 16)
    assert float(jnp.abs(probes[0]["do"]).sum()) > 0
    res = diagnostics.row_sum_residuals(**probes[0], causal=True, implementation="reference")
    assert res["post_cast"].shape == (2, 2, 16)


def test_standin_config_roundtrip(tmp_path):
    cfg = tiny_config(tmp_path)
    assert config_lib.RunConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg, steps=10).compat_dict() == cfg.compat_dict()
