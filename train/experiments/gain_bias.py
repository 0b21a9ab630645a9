"""Gain-gradient bias per attention arm: the mechanism, measured on fixed weights.

    python -m train.experiments.gain_bias --run-dir R \
        --arms stale,do_matched,matched,cudnn_fp8 --batches 32 --out DIR

On identical weights (the newest checkpoint of run R, `--step S`, or its initialization with
`--init`; or a fresh `--preset` model) and identical training batches (those the run would
see next), computes the gradient of the loss with respect to every query and key RMSNorm
gain (and every attention projection matrix) under each arm and under the f32 `reference`
arm. Per arm: the per-channel mean bias (arm - reference) and its standard error over the
batches, the share of channels with |t| > 3, bias norm against batch-to-batch noise, sign
agreement over batches, the Adam step the bias adds (in units of the learning rate), and
the correlation of the push with the gain product g_q * g_k. Contrasts `<arm>-matched` put
each arm against Delta-Matching directly.

Writes DIR/gain_bias.json (one entry per arm under "arms") and DIR/gain_bias_<arm>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from train import config as config_lib
from train import data as data_lib
from train import loop
from train import model as model_lib
from train.experiments import bias_stats, presets
from train.experiments.hooks import concat_hooks
from train.optim import param_path

REFERENCE = "reference"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.experiments.gain_bias", description=__doc__.split("\n")[0]
    )
    a = p.add_argument
    a("--run-dir", default=None, help="a training run (its config, data and checkpoints)")
    a("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    a("--init", action="store_true", help="use the run's initial weights, not a checkpoint")
    a("--preset", default=None, help="without --run-dir: a fresh model of this train preset")
    a("--seed", type=int, default=0, help="with --preset: initialization and data seed")
    a("--packing", default="concat", choices=config_lib.PACKINGS, help="with --preset")
    a("--arms", default="stale,do_matched,matched,cudnn_fp8", help="comma-separated arms")
    a("--batches", type=int, default=16, help="batches to average over (>= 2)")
    a("--data-start", type=int, default=None, help="first batch index (default: the step)")
    a("--batch-size", type=int, default=None, help="default: the run's")
    a("--seq-len", type=int, default=None, help="default: the run's")
    a(
        "--attention-implementation",
        default=None,
        choices=config_lib.IMPLEMENTATIONS,
        help="backend of the dm_jax arms (default: the run's, else the fastest available)",
    )
    a(
        "--attn-proj",
        default="arm",
        choices=("arm", "fp8", "bf16"),
        help="attention projections: as each arm trains (FP8 for FP8 arms), or one precision "
        "for all arms (bf16 isolates the attention core)",
    )
    a("--no-projections", action="store_true", help="gains only")
    a("--out", required=True, help="output directory")
    return p


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    for arm in arms:
        presets.unavailable_reason(arm, backend="gpu")  # raises on an unknown name
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"--arms: need distinct arms, got {text!r}")
    return arms


def _candidate_hooks(cfg) -> list[model_lib.ModelHooks]:
    """Comparison runs on concatenated data hold the model in a wrapper; plain runs do not."""
    plain = model_lib.default_hooks()
    return [concat_hooks(plain), plain] if cfg.data.packing == "concat" else [plain]


def load_weights(args) -> tuple[config_lib.RunConfig, model_lib.ModelHooks, nnx.State, int]:
    """(run config, hooks, parameters, step of the weights) from --run-dir or --preset."""
    if args.run_dir is None:
        if args.preset is None:
            raise ValueError("--run-dir: give a run directory, or --preset for a fresh model")
        cfg = config_lib.parse_args(
            ["--preset", args.preset, "--seed", str(args.seed), "--packing", args.packing]
        )
        hooks = model_lib.default_hooks()
        return cfg, hooks, nnx.state(hooks.build(cfg), nnx.Param), 0
    if args.preset is not None:
        raise ValueError("--preset: not with --run-dir (the run's config defines the model)")
    cfg = config_lib.RunConfig.load(args.run_dir)
    if args.init:
        hooks = _candidate_hooks(cfg)[0]
        return cfg, hooks, nnx.state(hooks.build(cfg), nnx.Param), 0
    errors = []
    for hooks in _candidate_hooks(cfg):
        try:
            model, _ = loop.load_model(args.run_dir, hooks=hooks, step=args.step)
        except ValueError as e:  # a checkpoint of the other model structure
            errors.append(str(e))
            continue
        step = args.step if args.step is not None else _newest_step(args.run_dir)
        return cfg, hooks, nnx.state(model, nnx.Param), step
    raise ValueError(f"--run-dir {args.run_dir!r}: cannot restore its weights ({errors[-1]})")


def _newest_step(run_dir: str) -> int:
    from train import checkpoint as ckpt_lib

    steps = ckpt_lib.complete_steps(os.path.join(run_dir, "checkpoints"))
    if not steps:
        raise ValueError(f"--run-dir {run_dir!r}: no checkpoint (use --init for the init)")
    return steps[-1]


def arm_config(cfg, arm: str, implementation: Optional[str], attn_proj: str):
    """`cfg` with the attention arm (and backend, projection precision) replaced."""
    spec = cfg.model.with_overrides(
        attention=arm,
        attention_implementation=implementation,
        attn_proj=None if attn_proj == "arm" else attn_proj,
    )
    return dataclasses.replace(cfg, model=spec)


def attention_matrices(model: nnx.Module) -> dict[str, jax.Array]:
    """{name: array} of every matrix (ndim >= 2) of every softmax-attention layer: the q, k,
    v, o (and MLA latent) projections, named by their path in the model."""
    from dm_jax.nn import GQAttention, MLAttention

    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (GQAttention, MLAttention)):
            prefix = "/".join(map(str, path))
            state = nnx.state(node, nnx.Param)
            for keypath, x in jax.tree_util.tree_leaves_with_path(state):
                if np.ndim(x) >= 2:
                    out[prefix + "/" + "/".join(map(str, param_path(keypath)))] = x
    return out


class ArmGradients:
    """One arm's model structure and jitted `grads(params, batch)` -> (gains, matrices):
    gains {layer: (dL/dg_q [D], dL/dg_k [D])}, matrices as `attention_matrices`, host f32."""

    def __init__(self, cfg, hooks, with_matrices: bool):
        model = hooks.build(cfg)
        self.graphdef, _, self.rest = nnx.split(model, nnx.Param, ...)
        self.hooks, self.with_matrices = hooks, with_matrices
        self._grad = jax.jit(lambda p, b: loop._grad_sums(self.graphdef, self.rest, p, b))

    def __call__(self, params, batch) -> tuple[dict, dict]:
        _, count, grads = self._grad(params, batch)
        grads = jax.tree.map(lambda g: g / max(float(count), 1.0), grads)
        as_model = nnx.merge(self.graphdef, grads, self.rest)
        host = lambda x: np.asarray(x, np.float32)  # noqa: E731
        gains = {
            int(layer): (host(q), host(k))
            for layer, (q, k) in self.hooks.qk_gains(as_model).items()
        }
        matrices = (
            {k: host(v) for k, v in attention_matrices(as_model).items()}
            if self.with_matrices
            else {}
        )
        return gains, matrices


def collect(args, cfg, hooks, params, arms, data_start: int, log=print) -> dict:
    """Per-batch gain gradients of every arm and the reference, and the projection moments.

    Returns {"gains": {arm: {layer: ([N, D] q, [N, D] k)}}, "matrices": {arm: {name:
    Moments}}, "failed": {arm: reason}}."""
    train_batches, _ = data_lib.make_batches(cfg, data_lib.load_splits(cfg.data), validation=False)
    runners, failed = {}, {}
    for arm in [REFERENCE] + [a for a in arms if a != REFERENCE]:
        arm_cfg = arm_config(cfg, arm, args.attention_implementation, args.attn_proj)
        runners[arm] = ArmGradients(arm_cfg, hooks, not args.no_projections)
    gains = {arm: {} for arm in runners}
    matrices = {arm: {} for arm in runners}
    for i in range(args.batches):
        start = time.perf_counter()
        batch = train_batches.batch(data_start + i)
        if cfg.data.packing == "concat":
            batch = dict(batch, segments=None)  # one stream; cuDNN FP8 takes no segment ids
        ref_gains, ref_matrices = runners[REFERENCE](params, batch)
        for arm, run in runners.items():
            if arm in failed:
                continue
            try:
                arm_gains, arm_matrices = (ref_gains, ref_matrices)
                if arm != REFERENCE:
                    arm_gains, arm_matrices = run(params, batch)
            except Exception as e:  # noqa: BLE001 - reported per arm, the others go on
                failed[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                log(f"  {arm} failed: {failed[arm]}")
                continue
            for layer, pair in arm_gains.items():
                gains[arm].setdefault(layer, ([], []))
                gains[arm][layer][0].append(pair[0])
                gains[arm][layer][1].append(pair[1])
            for name, x in arm_matrices.items():
                matrices[arm].setdefault(name, bias_stats.Moments()).add(x, ref_matrices[name])
        log(f"batch {i + 1}/{args.batches}: {time.perf_counter() - start:.1f} s")
    stacked = {
        arm: {layer: (np.stack(q), np.stack(k)) for layer, (q, k) in by_layer.items()}
        for arm, by_layer in gains.items()
        if arm not in failed
    }
    return dict(gains=stacked, matrices=matrices, failed=failed)


def _channels_json(ch: dict) -> dict:
    return {k: [float(x) for x in ch[k]] for k in ("bias", "se")}


def layer_channels(arm_gains: dict, ref_gains: dict) -> dict:
    """{"L<layer>": {"q": channel_bias, "k": channel_bias}} of one arm against the reference
    (or any two arms' per-batch gain gradients {layer: ([N, D] q, [N, D] k)})."""
    return {
        f"L{layer}": {
            which: bias_stats.channel_bias(arm_gains[layer][i], ref_gains[layer][i])
            for i, which in enumerate(("q", "k"))
        }
        for layer in sorted(arm_gains)
    }


def _arm_entry(channels: dict, products: dict, moments: dict) -> dict:
    """JSON entry of one arm: gain summaries (all gains, per layer and q/k), per-channel bias
    and standard error, and the projection summaries."""
    layers, joined, joined_products = {}, [], []
    for name, ch in channels.items():
        layers[name] = {w: bias_stats.summarize(ch[w], products[name]) for w in ("q", "k")}
        layers[name]["channels"] = {w: _channels_json(ch[w]) for w in ("q", "k")}
        joined += [ch["q"], ch["k"]]
        joined_products += [products[name], products[name]]
    entry = dict(status="done", reason=None)
    entry["gains"] = bias_stats.summarize(
        bias_stats.concat(joined), np.concatenate(joined_products)
    )
    entry["layers"] = layers
    if moments:
        by_name = {n: m.channels() for n, m in sorted(moments.items())}
        entry["projections"] = bias_stats.summarize(bias_stats.concat(by_name.values()))
        entry["projections_by_matrix"] = {n: bias_stats.summarize(c) for n, c in by_name.items()}
    return entry


def _joined(channels: dict) -> dict:
    return bias_stats.concat(ch[w] for ch in channels.values() for w in ("q", "k"))


def analyse(collected: dict, products: dict, arms: Sequence[str], packing: str) -> tuple:
    """(the "arms", "contrasts" and "stale_over_matched" parts of gain_bias.json, the
    per-arm `layer_channels` for the plots). `products`: {"L<layer>": [D] g_q * g_k}."""
    gains = collected["gains"]
    out, channels = {}, {}
    for arm in arms:
        reason = presets.unavailable_reason(arm, packing=packing)
        if reason:
            out[arm] = dict(status="not run", reason=reason)
        elif arm in collected["failed"]:
            out[arm] = dict(status="failed", reason=collected["failed"][arm])
        else:
            channels[arm] = layer_channels(gains[arm], gains[REFERENCE])
            out[arm] = _arm_entry(channels[arm], products, collected["matrices"].get(arm, {}))
    contrasts = {
        f"{arm}-matched": bias_stats.summarize(
            _joined(layer_channels(gains[arm], gains["matched"]))
        )
        for arm in channels
        if "matched" in channels and arm not in ("matched", REFERENCE)
    }
    ratio = {}
    if "stale" in channels and "matched" in channels:
        for part in ("gains", "projections"):
            if part in out["stale"] and out["matched"][part]["bias_norm"] > 0:
                ratio[part] = out["stale"][part]["bias_norm"] / out["matched"][part]["bias_norm"]
    return dict(arms=out, contrasts=contrasts, stale_over_matched=ratio), channels


def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    """A short text table of the per-arm gain (and projection) numbers."""
    head = (
        f"{'arm':<12} {'status':<8} {'bias/noise':>10} {'|t|>3':>7} {'sign agr':>8} "
        f"{'adam step':>9} {'corr push~gq*gk':>15} {'proj bias/noise':>15}"
    )
    lines = [head]
    for arm, e in result["arms"].items():
        if e["status"] != "done":
            lines.append(f"{arm:<12} {e['status']:<8} {e['reason']}")
            continue
        g, p = e["gains"], e.get("projections", {})
        lines.append(
            f"{arm:<12} {'done':<8} {_fmt(g['bias_to_noise']):>10} "
            f"{_fmt(g['share_abs_t_gt_3'], '.2f'):>7} {_fmt(g['sign_agreement'], '.2f'):>8} "
            f"{_fmt(g['adam_step_bias_mean']):>9} {_fmt(g.get('corr_push_product')):>15} "
            f"{_fmt(p.get('bias_to_noise')):>15}"
        )
    ratio = result["stale_over_matched"]
    if ratio:
        lines.append(
            "stale / matched bias norm: " + ", ".join(f"{k} {v:.3g}" for k, v in ratio.items())
        )
    return "\n".join(lines)


def _setup(args, cfg, step: int, data_start: int, seconds: float) -> dict:
    device = jax.devices()[0]
    return dict(
        command="python -m train.experiments.gain_bias " + " ".join(sys.argv[1:]),
        run_dir=args.run_dir,
        preset=args.preset,
        weights="init" if args.init or args.run_dir is None else f"checkpoint step {step}",
        step=step,
        reference=REFERENCE,
        batches=args.batches,
        data_start=data_start,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        model=cfg.model.name,
        packing=cfg.data.packing,
        attention_implementation=args.attention_implementation
        or dict(cfg.model.overrides).get("attention_implementation"),
        attn_proj=args.attn_proj,
        device=f"{jax.default_backend()} ({getattr(device, 'device_kind', device)})",
        jax=jax.__version__,
        seconds=round(seconds, 1),
        written=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        arms = _arms(args.arms)
        if args.batches < 2:
            raise ValueError(f"--batches: need >= 2 for a standard error, got {args.batches}")
        cfg, hooks, params, step = load_weights(args)
        cfg = dataclasses.replace(
            cfg,
            batch_size=args.batch_size or cfg.batch_size,
            seq_len=args.seq_len or cfg.seq_len,
        )
        data_start = step if args.data_start is None else args.data_start
        if data_start < 0:
            raise ValueError(f"--data-start: must be >= 0, got {data_start}")
    except ValueError as e:
        parser.error(str(e))
    runnable = [a for a in arms if presets.unavailable_reason(a, packing=cfg.data.packing) is None]
    shape = f"{args.batches} batches of {cfg.batch_size} x {cfg.seq_len}"
    print(f"{cfg.model.name}, {shape}; arms {runnable}")
    collected = collect(args, cfg, hooks, params, runnable, data_start)
    model = hooks.build(cfg)
    nnx.update(model, params)
    weight_gains = {
        f"L{layer}": (np.asarray(q, np.float64), np.asarray(k, np.float64))
        for layer, (q, k) in hooks.qk_gains(model).items()
    }
    if not weight_gains:
        parser.error("--run-dir: the model has no query/key RMSNorm gains (QK-norm off)")
    products = {name: q * k for name, (q, k) in weight_gains.items()}
    result, channels = analyse(collected, products, arms, cfg.data.packing)
    result["weight_gains"] = {
        name: dict(g_q=q.tolist(), g_k=k.tolist()) for name, (q, k) in weight_gains.items()
    }
    os.makedirs(args.out, exist_ok=True)
    result["plots"] = {
        arm: os.path.basename(bias_stats.plot_gain_bias(arm, ch, args.out, products))
        for arm, ch in channels.items()
    }
    result["setup"] = _setup(args, cfg, step, data_start, time.perf_counter() - start)
    path = os.path.join(args.out, "gain_bias.json")
    config_lib.write_json_atomic(path, result, indent=1, sort_keys=True)
    print(table(result))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
