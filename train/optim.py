"""optax optimizers: AdamW, or Muon for hidden matrices with AdamW for everything else.

Muon's parameters are chosen by the structure of the model, not by parameter names: a
parameter is a *hidden matrix* when it is 2-D, its owning module is not an embedding or a
convolution, it does not touch the vocabulary (embedding / LM head), and both dimensions are
wider than a short-convolution kernel. Embeddings, the LM head, norm gains, biases, convolution
kernels and per-head scalars go to AdamW.
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
        path = tuple(_key_name(k) for k in keypath)
        if path and path[-1] == "value":
            path = path[:-1]
        owner = nodes.get(path[:-1])
        return bool(x.ndim == 2 and not isinstance(owner, _NOT_MATRIX_MODULES)
                    and vocab_size not in x.shape and min(x.shape) >= _MIN_MATRIX_DIM)

    return jax.tree_util.tree_map_with_path(is_hidden, params)


def decay_mask(params):
    """Weight decay on matrices only (not on gains, biases or scalars)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def schedule(cfg, total_steps: int, peak: float) -> optax.Schedule:
    """Linear warmup to `peak`, cosine decay to `peak * min_lr_ratio` at `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=peak * cfg.min_lr_ratio)


def _adamw(cfg, lr, mask_fn=decay_mask):
    return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask_fn)


def build_optimizer(cfg, total_steps: int, hidden_mask) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or Muon+AdamW, on a warmup-cosine schedule.

    `hidden_mask` is the bool tree from `hidden_matrix_mask` (ignored for AdamW).
    """
    lr = schedule(cfg, total_steps, cfg.learning_rate)
    if cfg.name == "adamw":
        inner = _adamw(cfg, lr)
    else:
        adam_lr = schedule(cfg, total_steps, cfg.learning_rate * cfg.adam_lr_ratio)
        muon = optax.contrib.muon(lr, beta=cfg.b1 if cfg.b1 > 0.9 else 0.95,
                                  weight_decay=cfg.weight_decay)
        labels = jax.tree.map(lambda hidden: "muon" if hidden else "adamw", hidden_mask)
        inner = optax.multi_transform({"muon": muon, "adamw": _adamw(cfg, adam_lr)}, labels)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner)


def learning_rate(cfg, total_steps: int, step) -> float:
    """The (Muon or AdamW) peak-scaled learning rate used at `step`, for logging."""
    return schedule(cfg, total_steps, cfg.learning_rate)(step)
