"""optax optimizers: AdamW, or Muon for hidden matrices with AdamW for everything else.

Muon's parameters are chosen by the structure of the model, not by parameter names: a
parameter is a *hidden matrix* when it is 2-D, its owning module is not an embedding or a
convolution, it does not touch the vocabulary (embedding / LM head), and both dimensions are
wider than a short-convolution kernel. Embeddings, the LM head, norm gains, biases, convolution
kernels and per-head scalars go to AdamW.

The query/key RMSNorm gains of the attention layers (found the same way, by the layer that
owns them) can get their own learning rate, `qk_gain_lr_ratio` times the AdamW rate: a stress
setting for experiments on gain drift. No gain, bias or scalar ever gets weight decay
(`decay_mask`).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

_NOT_MATRIX_MODULES = (nnx.Embed, nnx.Conv)
_MIN_MATRIX_DIM = 16


def _key_name(k):
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def hidden_matrix_mask(model: nnx.Module, params: nnx.State, vocab_size: int):
    """Bool tree shaped like `params`: True where Muon should update the parameter."""
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}

    def is_hidden(keypath, x):
        path = param_path(keypath)
        owner = nodes.get(path[:-1])
        return bool(
            x.ndim == 2
            and not isinstance(owner, _NOT_MATRIX_MODULES)
            and vocab_size not in x.shape
            and min(x.shape) >= _MIN_MATRIX_DIM
        )

    return jax.tree_util.tree_map_with_path(is_hidden, params)


def param_path(keypath) -> tuple:
    """The names along a tree key path (a Variable's trailing `value` left out)."""
    path = tuple(_key_name(k) for k in keypath)
    return path[:-1] if path and path[-1] == "value" else path


def qk_gain_mask(model: nnx.Module, params: nnx.State):
    """Bool tree shaped like `params`: True for the query and key RMSNorm gains of every
    attention layer (`dm_jax.nn.GQAttention`, `dm_jax.nn.MLAttention` with QK-norm)."""
    from dm_jax.nn import GQAttention, MLAttention

    norms = set()
    for _, node in nnx.iter_graph(model):
        if isinstance(node, (GQAttention, MLAttention)) and node.q_norm is not None:
            norms |= {id(node.q_norm), id(node.k_norm)}
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}
    return jax.tree_util.tree_map_with_path(
        lambda keypath, _: id(nodes.get(param_path(keypath)[:-1])) in norms, params
    )


def decay_mask(params):
    """Weight decay on matrices only (not on gains, biases or scalars)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def schedule(cfg, total_steps: int, peak: float, extensions=()) -> optax.Schedule:
    """Linear warmup to `peak`, cosine decay to `peak * min_lr_ratio` at `total_steps`.

    `extensions` ((step, steps_before), ...) are the points where a resumed run changed its
    total (`RunConfig.extensions`). The schedule stays continuous through each: from `step`
    on, the rate decays by a half cosine from the value it had at `step` to the floor at the
    new total. A change during warmup just moves the end of the cosine (warmup is unchanged).
    """
    end = peak * cfg.min_lr_ratio
    totals = [before for _, before in extensions] + [total_steps]
    base_total, segments = totals[0], []
    for (at, _), new_total in zip(extensions, totals[1:]):
        if not segments and at <= cfg.warmup_steps:
            base_total = new_total  # still warming up: the same warmup, a later cosine end
        else:
            segments.append((at, new_total))
    warmup = min(cfg.warmup_steps, max(base_total - 1, 0))
    fns = [
        optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(base_total, warmup + 1),
            end_value=end,
        )
    ]
    for at, new_total in segments:
        joined = (
            optax.join_schedules(fns, [a for a, _ in segments[: len(fns) - 1]])
            if len(fns) > 1
            else fns[0]
        )
        start = float(joined(at))
        fns.append(
            optax.cosine_decay_schedule(
                start, max(new_total - at, 1), alpha=end / start if start else 1.0
            )
        )
    return fns[0] if len(fns) == 1 else optax.join_schedules(fns, [at for at, _ in segments])


def _adamw(cfg, lr, mask_fn=decay_mask):
    return optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask_fn
    )


def build_optimizer(
    cfg, total_steps: int, hidden_mask, extensions=(), qk_gain_mask=None
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or Muon+AdamW, on a warmup-cosine schedule.

    `hidden_mask` is the bool tree from `hidden_matrix_mask` (ignored for AdamW);
    `extensions` as in `schedule`. With `cfg.qk_gain_lr_ratio != 1`, the parameters that
    `qk_gain_mask` (the bool tree from `qk_gain_mask`) marks get their own AdamW with that
    multiple of the AdamW learning rate (same schedule shape, no weight decay).
    """
    lr = schedule(cfg, total_steps, cfg.learning_rate, extensions)
    adam_peak = cfg.learning_rate * (cfg.adam_lr_ratio if cfg.name == "muon" else 1.0)
    groups = {"adamw": _adamw(cfg, schedule(cfg, total_steps, adam_peak, extensions))}
    labels = jax.tree.map(
        lambda hidden: "muon" if hidden and cfg.name == "muon" else "adamw", hidden_mask
    )
    if cfg.name == "muon":
        groups["muon"] = optax.contrib.muon(
            lr, beta=cfg.b1 if cfg.b1 > 0.9 else 0.95, weight_decay=cfg.weight_decay
        )
    if cfg.qk_gain_lr_ratio != 1.0:
        if qk_gain_mask is None or not any(jax.tree.leaves(qk_gain_mask)):
            raise ValueError(
                f"--qk-gain-lr-ratio {cfg.qk_gain_lr_ratio}: the model has no query/key "
                "RMSNorm gains to apply it to (QK-norm off, or no attention layer)"
            )
        gain_lr = schedule(cfg, total_steps, adam_peak * cfg.qk_gain_lr_ratio, extensions)
        groups["qk_gain"] = _adamw(cfg, gain_lr)
        labels = jax.tree.map(
            lambda label, gain: "qk_gain" if gain else label, labels, qk_gain_mask
        )
    inner = groups["adamw"] if len(groups) == 1 else optax.multi_transform(groups, labels)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner)


def learning_rate(cfg, total_steps: int, step, extensions=()) -> float:
    """The (Muon or AdamW) peak-scaled learning rate used at `step`, for logging."""
    return schedule(cfg, total_steps, cfg.learning_rate, extensions)(step)
