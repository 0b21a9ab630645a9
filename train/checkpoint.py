"""Checkpoints with orbax: model parameters, optimizer state, step, data position and RNG.

Layout: `<run_dir>/checkpoints/<step>/{params,opt_state,meta}`. orbax writes each step into a temporary
directory and renames it when complete (atomic), and keeps the last K steps. Array trees are
stored as flat `{index: array}` dicts of their leaves, so the same code serves nnx States,
optax states and any model; the tree structure comes back from a freshly built template,
and a fingerprint of it guards against restoring into a different model or optimizer.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


def _flat(tree) -> dict:
    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(tree))}


def fingerprint(tree) -> str:
    """Hash of a tree's leaf paths, shapes and dtypes."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    desc = "".join(f"{jax.tree_util.keystr(p)}{np.shape(x)}{np.dtype(getattr(x, 'dtype', type(x)))}"
                   for p, x in leaves)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _abstract(flat: dict) -> dict:
    def spec(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return {k: spec(x) for k, x in flat.items()}


def checkpoint_dir(path: str) -> tuple[str, Optional[int]]:
    """A run dir, its checkpoints/ dir, or one step dir -> (checkpoints dir, step or None=latest)."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "meta")):
        return os.path.dirname(path), int(base)
    if os.path.isdir(path):
        return path, None
    raise ValueError(f"--init-from: no checkpoint at {path!r}")


ITEMS = ("params", "opt_state")


class Checkpointer:
    """Saves and restores the `ITEMS` array trees plus a JSON meta dict under one directory."""

    def __init__(self, directory: str, keep: int = 3, *, read_only: bool = False):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               read_only=read_only)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                             item_names=ITEMS + ("meta",))

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, trees: dict[str, Any], meta: dict) -> None:
        """`trees`: name in ITEMS -> array tree; `meta`: JSON-able dict."""
        meta = dict(meta, fingerprints={name: fingerprint(t) for name, t in trees.items()})
        items = {name: ocp.args.StandardSave(_flat(tree)) for name, tree in trees.items()}
        self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items), force=True)

    def restore(self, templates: dict[str, Any], step: Optional[int] = None) -> tuple[dict, dict]:
        """Restores the trees named in `templates` (same structure as saved) and the meta dict."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        for name, tree in templates.items():
            if meta["fingerprints"].get(name) != fingerprint(tree):
                raise ValueError(f"checkpoint step {step} in {self.manager.directory}: its {name!r} tree "
                                 "does not match this model/optimizer (different config?)")
        items = {name: ocp.args.StandardRestore(_abstract(_flat(tree))) for name, tree in templates.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        trees = {name: jax.tree.unflatten(jax.tree.structure(templates[name]),
                                          [restored[name][k] for k in sorted(restored[name])])
                 for name in templates}
        return trees, meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
