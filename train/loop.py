"""The training loop: `train(run_config) -> TrainResult` and `load_model(path)`.

One step: batch i (a pure function of seed and i) -> per-shard masked next-token cross
entropy and its gradients (inside shard_map, summed over the 'data' axis) -> global-norm
clipping and the optax update. Losses are checked one step late so the host never stalls the
device; a NaN/Inf stops the run before the next checkpoint, so the last good one survives.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dm_jax.arms import ARMS
from train import checkpoint as ckpt_lib
from train import config as config_lib
from train import data as data_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import optim, parallel, progress as progress_lib


class NonFiniteLoss(RuntimeError):
    """Raised when the training loss becomes NaN or Inf."""


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    step: int  # last completed step
    metrics: dict  # last metrics row
    status: str  # "done", "stopped" (--stop-at), "interrupted" (SIGINT/SIGTERM)
    checkpoint_step: Optional[int]
    tokens_per_s: float = float("nan")  # mean over the run, first (compiling) interval excluded


def _masked_ce_sums(graphdef, rest, params, batch):
    """(sum of masked CE, number of counted targets) for this shard's batch."""
    model = nnx.merge(graphdef, params, rest)
    logits_BTV = model(batch["tokens"], segment_ids=batch["segments"]).astype(jnp.float32)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    return jnp.sum(ce_BT * batch["mask"]), jnp.sum(batch["mask"])


def _grad_sums(graphdef, rest, params, batch):
    """(CE sum, target count, gradient of the CE sum) for one shard."""
    (ce_sum, count), grads = jax.value_and_grad(
        lambda p: _masked_ce_sums(graphdef, rest, p, batch), has_aux=True)(params)
    return ce_sum, count, grads


def _apply_update(tx, params, opt_state, ce_sum, count, grads):
    """Mean gradients from global sums -> optax update; returns (params, opt_state, stats)."""
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(loss=ce_sum / count, grad_norm=optax.global_norm(grads))


def make_step_fns(graphdef, rest, tx, mesh):
    """(train_step, eval_step), jitted over `mesh` (per-shard sums inside shard_map).

    train_step(params, opt_state, batch) -> (params, opt_state, stats)
    eval_step(params, batch) -> (ce_sum, count)
    """
    sharded_grads = parallel.per_shard_sums(functools.partial(_grad_sums, graphdef, rest), mesh)
    sharded_eval = parallel.per_shard_sums(functools.partial(_masked_ce_sums, graphdef, rest), mesh)

    @jax.jit
    def train_step(params, opt_state, batch):
        return _apply_update(tx, params, opt_state, *sharded_grads(params, batch))

    return train_step, jax.jit(sharded_eval)


def make_pmap_step(graphdef, rest, tx, axis_name: str = "devices"):
    """The same train step under `jax.pmap`: params/opt_state replicated with a leading device
    axis, batch leaves [n_devices, B/n_devices, T]."""

    def step(params, opt_state, batch):
        sums = jax.lax.psum(_grad_sums(graphdef, rest, params, batch), axis_name)
        return _apply_update(tx, params, opt_state, *sums)

    return jax.pmap(step, axis_name=axis_name)


def _prepare_run_dir(cfg) -> Optional[config_lib.RunConfig]:
    """Creates or checks the run dir; returns the saved config when resuming."""
    path = os.path.join(cfg.run_dir, "config.json")
    if os.path.exists(path):
        saved = config_lib.RunConfig.load(cfg.run_dir)
        config_lib.check_compatible(saved, cfg)
        if not cfg.resume:
            raise ValueError(f"--run-dir {cfg.run_dir!r} already holds a run; pass --resume to continue "
                             "it or choose a new --run-dir")
        return saved
    if cfg.resume:
        raise ValueError(f"--resume: no run to resume in --run-dir {cfg.run_dir!r}")
    if os.path.isdir(cfg.run_dir) and os.listdir(cfg.run_dir):
        raise ValueError(f"--run-dir {cfg.run_dir!r} exists and is not a run directory; choose a new one")
    os.makedirs(cfg.run_dir, exist_ok=True)
    return None


class _StopSignals:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps."""

    def __init__(self):
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _model_state(cfg, hooks):
    model = hooks.build(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return model, graphdef, params, rest


def _gain_metrics(hooks, model) -> dict:
    if hooks.qk_gains is None or hooks.gain_statistics is None:
        return {}
    return metrics_lib.gain_rows(hooks.qk_gains(model), hooks.gain_statistics)


def _probe_metrics(hooks, model, cfg, batch) -> dict:
    """dS row-sum residuals of every attention layer on (the first rows of) a real batch."""
    if hooks.attention_probe is None or hooks.row_sum_residuals is None:
        return {}
    n = min(2, batch["tokens"].shape[0])
    segments = batch["segments"][:n] if cfg.data.packing == "segments" else None
    probes = hooks.attention_probe(model, batch["tokens"][:n], batch["targets"][:n], segment_ids=segments)
    delta = ARMS[cfg.attention].probe_delta
    impl = dict(cfg.model.overrides).get("attention_implementation")
    residuals = {layer: hooks.row_sum_residuals(p["q"], p["k"], p["v"], p["do"], causal=True, delta=delta,
                                                segment_ids=segments, implementation=impl)
                 for layer, p in probes.items()}
    return metrics_lib.residual_rows(residuals)


def _evaluate(eval_step, params, val_batches, cfg, mesh, shard) -> float:
    ce, count = 0.0, 0.0
    for i in range(cfg.eval_batches):
        c, n = eval_step(params, parallel.put_batch(val_batches.batch(i, **shard), mesh))
        ce, count = ce + float(c), count + float(n)
    return ce / max(count, 1.0)


def train(run_config: config_lib.RunConfig, *, progress: bool = True,
          hooks: Optional[model_lib.ModelHooks] = None) -> TrainResult:
    """Trains (or resumes) the run described by `run_config`; writes config.json, metrics.jsonl,
    tensorboard/ and checkpoints/ under `run_config.run_dir`."""
    cfg, hooks = run_config, hooks or model_lib.default_hooks()
    if cfg.distributed:
        parallel.initialize_distributed()
    mesh = parallel.make_mesh(cfg.model_parallel)
    parallel.check_batch(cfg.batch_size, mesh)
    _prepare_run_dir(cfg)
    console = progress_lib.Console(enabled=progress)

    splits = data_lib.load_splits(cfg.data)
    train_batches, val_batches = data_lib.make_batches(cfg, splits)
    model, graphdef, params, rest = _model_state(cfg, hooks)
    model_vocab = getattr(getattr(model, "config", None), "vocab_size", splits.vocab_size)
    if model_vocab < splits.vocab_size:
        raise ValueError(f"--data: token ids reach {splits.vocab_size - 1} but the model vocabulary "
                         f"is {model_vocab}")
    hidden = optim.hidden_matrix_mask(model, params, model_vocab)
    tx = cfg.optimizer.build(cfg.steps, hidden)
    opt_state = tx.init(params)
    cfg.save(cfg.run_dir, getattr(model, "config", None))
    checkpointer = ckpt_lib.Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), cfg.keep_checkpoints)

    step = 0
    if cfg.resume and checkpointer.latest_step() is not None:
        trees, meta = checkpointer.restore({"params": params, "opt_state": opt_state})
        params, opt_state, step = trees["params"], trees["opt_state"], int(meta["step"])
        console.note(f"resumed from step {step}")
    elif cfg.init_from:
        directory, init_step = ckpt_lib.checkpoint_dir(cfg.init_from)
        templates = {"params": params} if cfg.fresh_optimizer else {"params": params, "opt_state": opt_state}
        trees, meta = ckpt_lib.Checkpointer(directory, read_only=True).restore(templates, init_step)
        params, opt_state = trees["params"], trees.get("opt_state", opt_state)
        console.note(f"initialized from {cfg.init_from} (step {meta['step']})")

    params, opt_state = parallel.shard_params(params, mesh), parallel.shard_params(opt_state, mesh)
    train_step, eval_step = make_step_fns(graphdef, rest, tx, mesh)
    shard = dict(shard=jax.process_index(), num_shards=jax.process_count())
    log = metrics_lib.MetricsLog(cfg.run_dir, truncate_after=step if cfg.resume else None)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_stop = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    status, saved_step, pending, first_step = "done", None, None, step
    console.start(cfg, splits, hooks_model=model, first_step=step, last_step=last_stop)

    def save(at_step):
        checkpointer.save(at_step, {"params": params, "opt_state": opt_state},
                          {"step": at_step, "data_position": at_step, "seed": cfg.seed})
        return at_step

    def check(pending_step, stats):
        loss = float(stats["loss"])
        if not np.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss} at step {pending_step}; stopping. The last good "
                                f"checkpoint (step {checkpointer.latest_step()}) is kept in {cfg.run_dir}")
        return loss

    t_last, step_last = time.perf_counter(), step
    timed = [0, 0.0]  # tokens, seconds of logged intervals after the first
    try:
        with _StopSignals() as signals:
            while step < last_stop:
                batch_np = train_batches.batch(step, **shard)
                params, opt_state, stats = train_step(params, opt_state, parallel.put_batch(batch_np, mesh))
                if pending is not None:
                    check(*pending)
                step += 1
                pending = (step, stats)
                evaluate = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == last_stop)
                probe = bool(cfg.probe_every) and step % cfg.probe_every == 0
                row = None
                if evaluate or probe or (cfg.log_every and (step % cfg.log_every == 0 or step == last_stop)):
                    loss = check(*pending)
                    now = time.perf_counter()
                    row = dict(step=step, loss=loss, lr=float(optim.learning_rate(cfg.optimizer, cfg.steps, step - 1)),
                               grad_norm=float(stats["grad_norm"]),
                               tokens_per_s=tokens_per_step * (step - step_last) / (now - t_last))
                    nnx.update(model, params)
                    row.update(_gain_metrics(hooks, model))
                    if probe:
                        row.update(_probe_metrics(hooks, model, cfg, batch_np))
                    if evaluate:
                        row["val_ce"] = _evaluate(eval_step, params, val_batches, cfg, mesh, shard)
                if row is not None:
                    if step_last > first_step:
                        timed[0] += tokens_per_step * (step - step_last)
                        timed[1] += now - t_last
                    log.write(row)
                    console.update(step, row)
                    t_last, step_last = time.perf_counter(), step
                else:
                    console.advance(step)
                if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < last_stop:
                    check(*pending)
                    saved_step = save(step)
                if signals.received is not None:
                    status = "interrupted"
                    break
            check(*pending) if pending else None
            saved_step = save(step) if saved_step != step else saved_step
            if status == "done" and step < cfg.steps:
                status = "stopped"
    finally:
        checkpointer.close()
        log.close()
        console.stop()
    mean_tps = timed[0] / timed[1] if timed[1] else log.last.get("tokens_per_s", float("nan"))
    result = TrainResult(cfg.run_dir, step, log.last, status, saved_step, mean_tps)
    console.summary(result, cfg)
    return result


def load_model(path: str, *, hooks: Optional[model_lib.ModelHooks] = None, step: Optional[int] = None):
    """A trained model from a run dir (latest checkpoint) or a checkpoint step dir.

    Returns (model, run_config); the model holds the checkpoint's parameters."""
    directory, ckpt_step = ckpt_lib.checkpoint_dir(path)
    run_dir = os.path.dirname(directory)
    cfg = config_lib.RunConfig.load(run_dir)
    hooks = hooks or model_lib.default_hooks()
    model, _, params, _ = _model_state(cfg, hooks)
    trees, _ = ckpt_lib.Checkpointer(directory, read_only=True).restore(
        {"params": params}, step if step is not None else ckpt_step)
    nnx.update(model, trees["params"])
    return model, cfg
