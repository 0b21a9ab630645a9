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
import shutil
import signal
import socket
import sys
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
from train import compile_cache, xla_flags
from train import config as config_lib
from train import data as data_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import memory as memory_lib
from train import optim, parallel, progress as progress_lib
from train import throughput


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
    compile_seconds: float = float("nan")  # the first train_step call: trace, lower, compile
    compile_cache: str = ""  # where the step came from (compile_cache.CacheEvents.describe)
    utilisation: dict = dataclasses.field(default_factory=dict)  # throughput.utilisation()


def _masked_ce_sums(graphdef, rest, params, batch):
    """(sum of masked CE, number of counted targets) for this shard's batch."""
    model = nnx.merge(graphdef, params, rest)
    logits_BTV = model(batch["tokens"], segment_ids=batch["segments"]).astype(jnp.float32)
    with jax.named_scope("loss"):
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
        return jnp.sum(ce_BT * batch["mask"]), jnp.sum(batch["mask"])


def _grad_sums(graphdef, rest, params, batch):
    """(CE sum, target count, gradient of the CE sum) for one shard."""
    (ce_sum, count), grads = jax.value_and_grad(
        lambda p: _masked_ce_sums(graphdef, rest, p, batch), has_aux=True
    )(params)
    return ce_sum, count, grads


def _apply_update(tx, params, opt_state, ce_sum, count, grads):
    """Mean gradients from global sums -> optax update; returns (params, opt_state, stats)."""
    with jax.named_scope("optimizer"):
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


def _check_run_dir(cfg) -> Optional[config_lib.RunConfig]:
    """Checks --run-dir before any work (nothing is created yet); returns the saved config
    when resuming."""
    run_dir = cfg.run_dir
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"--run-dir {run_dir!r}: is a file, expected a directory")
    if os.path.exists(os.path.join(run_dir, "config.json")):
        saved = config_lib.RunConfig.load(run_dir)
        config_lib.check_compatible(saved, cfg)
        if not cfg.resume:
            raise ValueError(
                f"--run-dir {run_dir!r} already holds a run; pass --resume to continue "
                "it or choose a new --run-dir"
            )
        _check_writable(run_dir, run_dir)
        return saved
    if cfg.resume:
        raise ValueError(f"--resume: no run to resume in --run-dir {run_dir!r}")
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        raise ValueError(
            f"--run-dir {run_dir!r} exists and is not a run directory; choose a new one"
        )
    parent = os.path.abspath(run_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--run-dir {run_dir!r}: {parent!r} is a file, expected a directory")
    _check_writable(parent, run_dir)
    return None


def _check_writable(path: str, run_dir: str) -> None:
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--run-dir {run_dir!r}: cannot write in {path!r} (permission denied)")


def _create_run_dir(cfg) -> bool:
    """Creates the run dir (if new); returns whether this call created it."""
    if os.path.isdir(cfg.run_dir):
        return False
    try:
        os.makedirs(cfg.run_dir)
    except OSError as e:
        raise ValueError(f"--run-dir {cfg.run_dir!r}: cannot create it ({e.strerror or e})") from e
    return True


def _save_config(cfg, model) -> None:
    try:
        cfg.save(cfg.run_dir, getattr(model, "config", None))
    except OSError as e:
        raise ValueError(
            f"--run-dir {cfg.run_dir!r}: cannot write config.json ({e.strerror or e})"
        ) from e


class _StopSignals:
    """SIGINT/SIGTERM handling for the training loop.

    The first signal asks the loop to stop after the current step, with a checkpoint. A second
    one ends the process at once (exit status 128 + signal), even inside a long step or a
    compilation, after printing which checkpoint the run resumes from; a checkpoint being
    written then is discarded whole (orbax renames complete checkpoints only).

    Python runs signal handlers only in the main thread and only between bytecodes, so a
    main thread blocked in XLA for minutes would see neither signal. `signal.set_wakeup_fd`
    makes the interpreter's C-level handler write each signal number to a socket at once;
    a watchdog thread reads it there.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, resume_hint=lambda: ""):
        self.received: Optional[int] = None
        self.count = 0
        self._resume_hint = resume_hint
        self._old, self._old_fd, self._thread = {}, None, None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="stop-signals", daemon=True)
        self._thread.start()
        return self

    def _handle(self, signum, frame):
        if self.received is None:  # the watchdog counts and reports; this makes the flag exact
            self.received = signum

    def _watch(self):
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self._on_signal(signal.Signals(signum))

    def _on_signal(self, sig) -> None:
        self.count += 1
        if self.count == 1:
            if self.received is None:
                self.received = int(sig)
            _say(
                f"{sig.name}: stopping after the current step, with a checkpoint "
                f"(send it again to stop at once)"
            )
            return
        _say(f"{sig.name} again: stopping now. {self._resume_hint()}")
        os._exit(128 + int(sig))

    def __exit__(self, *exc):
        if self._thread is None:
            return False
        signal.set_wakeup_fd(self._old_fd)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._writer.close()  # the watchdog reads end-of-file and returns
        self._thread.join(timeout=5)
        self._reader.close()
        return False


def _say(text: str) -> None:
    sys.stderr.write(f"\n{text}\n")
    sys.stderr.flush()


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
    probes = hooks.attention_probe(
        model, batch["tokens"][:n], batch["targets"][:n], segment_ids=segments
    )
    delta = ARMS[cfg.attention].probe_delta
    impl = dict(cfg.model.overrides).get("attention_implementation")
    residuals = {
        layer: hooks.row_sum_residuals(
            p["q"],
            p["k"],
            p["v"],
            p["do"],
            causal=True,
            delta=delta,
            segment_ids=segments,
            implementation=impl,
        )
        for layer, p in probes.items()
    }
    return metrics_lib.residual_rows(residuals)


def _evaluate(eval_step, params, val_batches, cfg, mesh, shard) -> float:
    ce, count = 0.0, 0.0
    for i in range(cfg.eval_batches):
        c, n = eval_step(params, parallel.put_batch(val_batches.batch(i, **shard), mesh))
        ce, count = ce + float(c), count + float(n)
    return ce / max(count, 1.0)


def _restore_for_resume(cfg, checkpointer, templates, console):
    """(step, trees) of the newest readable checkpoint, or (0, None) if there is none yet.

    Damaged checkpoints newer than it are reported and moved, unchanged, to
    `<run_dir>/damaged_checkpoints/` so that new checkpoints never count or overwrite them."""
    found, damaged = checkpointer.restore_latest_good(templates)
    if found is None:
        console.note("no checkpoint yet: starting from step 0")
        return 0, None
    step, trees, _ = found
    for bad_step, reason in damaged:
        target = checkpointer.set_aside(bad_step, os.path.join(cfg.run_dir, "damaged_checkpoints"))
        _say(
            f"warning: {reason}\n  moved it unchanged to {target}; resuming from the checkpoint at step {step}"
        )
    console.note(f"resumed from step {step}")
    return step, trees


def _extend(cfg, saved, step: int):
    """`cfg` with the saved run's schedule extensions, plus one if --steps changed at `step`."""
    extensions = tuple(saved.extensions)
    if cfg.steps != saved.steps:
        if step >= cfg.steps:
            raise ValueError(
                f"--steps {cfg.steps}: the run is already at step {step}; give a larger "
                "--steps to extend it"
            )
        extensions += ((step, saved.steps),)
    if cfg.stop_at is not None and cfg.stop_at <= step:
        raise ValueError(f"--stop-at {cfg.stop_at}: the run is already at step {step}")
    return dataclasses.replace(cfg, extensions=extensions)


def _resume_hint(cfg) -> str:
    """Which checkpoint a stopped run continues from (complete ones only), and the command."""
    steps = ckpt_lib.complete_steps(os.path.join(cfg.run_dir, "checkpoints"))
    cmd = f"python -m train --resume --run-dir {cfg.run_dir}"
    if not steps:
        return f"No checkpoint was written yet; {cmd} starts the run again from step 0."
    return f"The run resumes from its checkpoint at step {steps[-1]}: {cmd}"


def train(
    run_config: config_lib.RunConfig,
    *,
    progress: bool = True,
    hooks: Optional[model_lib.ModelHooks] = None,
) -> TrainResult:
    """Trains (or resumes) the run described by `run_config`; writes config.json, metrics.jsonl,
    tensorboard/ and checkpoints/ under `run_config.run_dir`.

    Everything that can be checked is checked before the run dir is created (flags, data,
    memory estimate); a new run dir that fails before its first step is removed again."""
    cfg, hooks = run_config, hooks or model_lib.default_hooks()
    if cfg.distributed:
        parallel.initialize_distributed()
    mesh = parallel.make_mesh(cfg.model_parallel)
    parallel.check_batch(cfg.batch_size, mesh)
    saved = _check_run_dir(cfg)
    console = progress_lib.Console(enabled=progress)
    cache_dir = compile_cache.enable(cfg.compile_cache)
    console.note(f"compilation cache: {cache_dir or 'off'}")
    gemm = xla_flags.use_gemm(cfg.xla_gemm)
    if gemm != cfg.xla_gemm and jax.default_backend() == "gpu":
        console.note(f"XLA's matmuls: {gemm} (XLA_FLAGS or an earlier start of jax decided)")

    splits = data_lib.load_splits(cfg.data)
    train_batches, val_batches = data_lib.make_batches(cfg, splits)
    if not cfg.skip_memory_check:
        cfg, note = memory_lib.check_or_remat(cfg, hooks.build, mesh)
        console.note(note)
    model, graphdef, params, rest = _model_state(cfg, hooks)
    model_vocab = getattr(getattr(model, "config", None), "vocab_size", splits.vocab_size)
    state_passes = _state_passes(model, cfg.seq_len)
    if state_passes:
        console.note(
            "linear mixers' state pass: " + ", ".join(f"{k} {v}" for k, v in state_passes.items())
        )
    if model_vocab < splits.vocab_size:
        raise ValueError(
            f"--data: token ids reach {splits.vocab_size - 1} but the model vocabulary "
            f"is {model_vocab}"
        )
    hidden = optim.hidden_matrix_mask(model, params, model_vocab)
    gains = optim.qk_gain_mask(model, params)
    opt_state = cfg.optimizer.build(cfg.steps, hidden, qk_gain_mask=gains).init(
        params
    )  # the schedule does not shape it
    created = _create_run_dir(cfg)
    try:
        checkpointer = ckpt_lib.Checkpointer(
            os.path.join(cfg.run_dir, "checkpoints"), cfg.keep_checkpoints
        )
        step, trees = 0, None
        if cfg.resume:
            step, trees = _restore_for_resume(
                cfg, checkpointer, {"params": params, "opt_state": opt_state}, console
            )
            cfg = _extend(cfg, saved, step) if saved is not None else cfg
        if trees is not None:
            params, opt_state = trees["params"], trees["opt_state"]
        elif cfg.init_from:
            templates = (
                {"params": params}
                if cfg.fresh_optimizer
                else {"params": params, "opt_state": opt_state}
            )
            trees, meta = _restore_read_only(cfg.init_from, templates)
            params, opt_state = trees["params"], trees.get("opt_state", opt_state)
            console.note(f"initialized from {cfg.init_from} (step {meta['step']})")
        _save_config(cfg, model)
        tx = cfg.optimizer.build(cfg.steps, hidden, cfg.extensions, qk_gain_mask=gains)
        return _run(
            cfg,
            hooks,
            console,
            mesh,
            checkpointer,
            dict(model=model, graphdef=graphdef, rest=rest),
            tx,
            params,
            opt_state,
            step,
            (train_batches, val_batches, splits),
        )
    except BaseException:
        if created and not _has_progress(cfg.run_dir):
            shutil.rmtree(
                cfg.run_dir, ignore_errors=True
            )  # a run that never took a step: no litter
        raise


def _has_progress(run_dir: str) -> bool:
    """Whether a run dir holds a logged step or a checkpoint."""
    return bool(
        metrics_lib.read_metrics(run_dir)
        or ckpt_lib.complete_steps(os.path.join(run_dir, "checkpoints"))
    )


def _run(
    cfg, hooks, console, mesh, checkpointer, parts, tx, params, opt_state, step, data
) -> TrainResult:
    """The training loop proper, from `step` to the run's last step. `parts`: the model, its
    graphdef and non-parameter state; `data`: (train batches, validation batches, splits)."""
    model, graphdef, rest = parts["model"], parts["graphdef"], parts["rest"]
    train_batches, val_batches, splits = data
    train_step, eval_step = make_step_fns(graphdef, rest, tx, mesh)
    params, opt_state = parallel.shard_params(params, mesh), parallel.shard_params(opt_state, mesh)
    shard = dict(shard=jax.process_index(), num_shards=jax.process_count())
    log = metrics_lib.MetricsLog(cfg.run_dir, truncate_after=step if cfg.resume else None)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_stop = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    status, saved_step, pending, first_step = "done", None, None, step
    if step >= last_stop:  # a finished run resumed without a larger --steps
        checkpointer.close()
        log.close()
        console.note(f"the run is complete at step {step}; give a larger --steps to extend it")
        return TrainResult(
            cfg.run_dir,
            step,
            log.last or (metrics_lib.read_metrics(cfg.run_dir) or [{}])[-1],
            "done",
            step,
        )
    console.start(cfg, splits, hooks_model=model, first_step=step, last_step=last_stop)

    def save(at_step):
        checkpointer.save(
            at_step,
            {"params": params, "opt_state": opt_state},
            {"step": at_step, "data_position": at_step, "seed": cfg.seed},
        )
        return at_step

    def check(pending_step, stats):
        loss = float(stats["loss"])
        if not np.isfinite(loss):
            good = ckpt_lib.complete_steps(checkpointer.directory)
            raise NonFiniteLoss(
                f"loss is {loss} at step {pending_step}; stopping. The last good "
                f"checkpoint (step {good[-1] if good else None}) is kept in {cfg.run_dir}"
            )
        return loss

    t_last, step_last = time.perf_counter(), step
    timed = [0, 0.0]  # tokens, seconds of logged intervals after the first
    compiled = [float("nan"), ""]  # seconds of the first train_step call, cache outcome
    try:
        with _StopSignals(functools.partial(_resume_hint, cfg)) as signals:
            while step < last_stop:
                batch_np = train_batches.batch(step, **shard)
                batch = parallel.put_batch(batch_np, mesh)
                if step == first_step:  # compiles (or loads) before dispatching: timed alone
                    with compile_cache.CacheEvents() as events:
                        t0 = time.perf_counter()
                        params, opt_state, stats = train_step(params, opt_state, batch)
                        compiled[:] = time.perf_counter() - t0, events.describe()
                else:
                    params, opt_state, stats = train_step(params, opt_state, batch)
                if pending is not None:
                    check(*pending)
                step += 1
                pending = (step, stats)
                evaluate = bool(cfg.eval_every) and (
                    step % cfg.eval_every == 0 or step == last_stop
                )
                probe = bool(cfg.probe_every) and step % cfg.probe_every == 0
                row = None
                if (
                    evaluate
                    or probe
                    or (cfg.log_every and (step % cfg.log_every == 0 or step == last_stop))
                ):
                    loss = check(*pending)
                    now = time.perf_counter()
                    lr = optim.learning_rate(cfg.optimizer, cfg.steps, step - 1, cfg.extensions)
                    row = dict(
                        step=step,
                        loss=loss,
                        lr=float(lr),
                        grad_norm=float(stats["grad_norm"]),
                        tokens_per_s=tokens_per_step * (step - step_last) / (now - t_last),
                    )
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
            checkpointer.wait()
            if status == "done" and step < cfg.steps:
                status = "stopped"
    finally:
        checkpointer.close()
        log.close()
        console.stop()
    mean_tps = timed[0] / timed[1] if timed[1] else log.last.get("tokens_per_s", float("nan"))
    util = throughput.utilisation(throughput.non_embedding_params(model), mean_tps)
    result = TrainResult(cfg.run_dir, step, log.last, status, saved_step, mean_tps, *compiled, util)
    _write_summary(result, cfg, _state_passes(model, cfg.seq_len))
    console.summary(result, cfg)
    return result


def _state_passes(model, seq_len: int) -> dict:
    """{mixer kind: state pass} of a HybridLM (what "auto" chose), {} for other models."""
    state_passes = getattr(getattr(model, "config", None), "state_passes", None)
    return state_passes(seq_len) if callable(state_passes) else {}


def _write_summary(result: TrainResult, cfg, state_passes: dict) -> None:
    """`<run_dir>/summary.json`: this invocation's speed (tokens/s after compilation, compile
    seconds, model FLOP/s, MFU), where it ended, the device's peak memory (None on a CPU)
    and the settings chosen for this machine (XLA_FLAGS, the linear mixers' state passes)."""
    payload = dict(
        step=result.step,
        status=result.status,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        tokens_per_s=result.tokens_per_s,
        compile_seconds=result.compile_seconds,
        compile_cache=result.compile_cache,
        peak_device_bytes=memory_lib.peak_device_bytes(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        state_passes=state_passes,
        **result.utilisation,
    )
    clean = {
        k: (v if not isinstance(v, float) or np.isfinite(v) else None) for k, v in payload.items()
    }
    config_lib.write_json_atomic(os.path.join(cfg.run_dir, "summary.json"), clean, indent=2)


def _restore_read_only(path: str, templates: dict, step: Optional[int] = None) -> tuple[dict, dict]:
    """Trees and meta from a run dir or checkpoint dir, without writing anything: the given
    step, else the newest readable checkpoint (damaged newer ones are reported, not moved)."""
    directory, path_step = ckpt_lib.checkpoint_dir(path)
    checkpointer = ckpt_lib.Checkpointer(directory, read_only=True)
    step = step if step is not None else path_step
    if step is not None:
        return checkpointer.restore(templates, step)
    found, damaged = checkpointer.restore_latest_good(templates)
    if found is None:
        raise ValueError(f"{path}: no checkpoint in {directory}")
    for _, reason in damaged:
        _say(f"warning: {reason}; using the checkpoint at step {found[0]}")
    return found[1], found[2]


def load_model(
    path: str, *, hooks: Optional[model_lib.ModelHooks] = None, step: Optional[int] = None
):
    """A trained model from a run dir (latest readable checkpoint) or a checkpoint step dir.

    Returns (model, run_config); the model holds the checkpoint's parameters."""
    directory, _ = ckpt_lib.checkpoint_dir(path)
    cfg = config_lib.RunConfig.load(os.path.dirname(directory))
    hooks = hooks or model_lib.default_hooks()
    model, _, params, _ = _model_state(cfg, hooks)
    trees, _ = _restore_read_only(path, {"params": params}, step)
    nnx.update(model, trees["params"])
    return model, cfg
