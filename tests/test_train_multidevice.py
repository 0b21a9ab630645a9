"""Several devices on a CPU (fake host devices, in a subprocess): same loss as one device.

The subprocess runs with XLA_FLAGS=--xla_force_host_platform_device_count=4 so the device
count of this test process is left alone.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from test_train_standin import HOOKS, tiny_config
from train import loop

TESTS = os.path.dirname(os.path.abspath(__file__))
KW = dict(steps=3, batch_size=4, eval_every=3, probe_every=0, ckpt_every=0, log_every=1)

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import dm_jax
    from test_train_standin import HOOKS, tiny_config
    from train import loop

    out, kw, model_parallel = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    assert jax.device_count() == 4, jax.devices()
    r = loop.train(tiny_config(f"{out}/run", model_parallel=model_parallel, **kw), progress=False, hooks=HOOKS)
    result = dict(final=[r.metrics["loss"], r.metrics["val_ce"]])
    if model_parallel > 1:
        json.dump(result, open(f"{out}/result.json", "w"))
        sys.exit(0)

    # The attention op under pmap equals the op on the whole batch.
    x = jax.random.normal(jax.random.key(0), (3, 4, 32, 2, 16))
    ref = dm_jax.attention(x[0], x[1], x[2], causal=True, implementation="reference")
    pm = jax.pmap(lambda q, k, v: dm_jax.attention(q, k, v, causal=True, implementation="reference"))(
        *(a.reshape(4, 1, 32, 2, 16) for a in x))
    result["pmap_attention_err"] = float(jnp.abs(pm.reshape(ref.shape) - ref).max())

    # A train step under pmap equals the jit/shard_map step on one device mesh.
    cfg = tiny_config(f"{out}/unused", **kw)
    model = HOOKS.build(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = cfg.optimizer.build(cfg.steps, jax.tree.map(lambda _: False, params))
    opt_state = tx.init(params)
    from train import data as data_lib
    batches, _ = data_lib.make_batches(cfg, data_lib.load_splits(cfg.data))
    batch = batches.batch(0)
    n = jax.device_count()
    rep = lambda t: jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), t)
    _, _, stats = loop.make_pmap_step(graphdef, rest, tx)(
        rep(params), rep(opt_state), {k: v.reshape(n, -1, *v.shape[1:]) for k, v in batch.items()})
    result["pmap_loss"] = float(stats["loss"][0])
    json.dump(result, open(f"{out}/result.json", "w"))
""")


@pytest.mark.parametrize("model_parallel", [1, 2], ids=["data4", "data2_model2"])
def test_several_devices_match_one_device(tmp_path, model_parallel):
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(
            [TESTS, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(KW), str(model_parallel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.load(open(tmp_path / "result.json"))

    one = loop.train(tiny_config(tmp_path / "one", **KW), progress=False, hooks=HOOKS)
    np.testing.assert_allclose(
        result["final"], [one.metrics["loss"], one.metrics["val_ce"]], rtol=2e-4
    )
    if model_parallel == 1:  # pmap: the attention op and a train step
        assert result["pmap_attention_err"] < 1e-5
        first = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")][0]
        np.testing.assert_allclose(result["pmap_loss"], first["loss"], rtol=2e-4)
