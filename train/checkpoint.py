"""Checkpoints with orbax: model parameters, optimizer state, step, data position and RNG.

Layout: `<run_dir>/checkpoints/<step>/{params,opt_state,meta}`. orbax writes each step into a
temporary directory and renames it when complete (atomic), and keeps the last K steps.

Array trees are stored under their names: `params` holds the model's parameters as nested
dicts keyed by module path (`layers/0/mixer/q_proj/kernel`, ...), `opt_state` the optimizer
state keyed by its own path (`1/0/mu/layers/0/...`), so orbax alone reads a checkpoint:

    ocp.StandardCheckpointer().restore("RUN/checkpoints/400/params")

The tree structure comes back from a freshly built template, and a fingerprint of it (leaf
paths, shapes, dtypes; kept in `meta`) guards against restoring into a different model or
optimizer. Checkpoints written before names were stored (flat `"00000"` keys, no
`meta["layout"]`) still restore.

A checkpoint that cannot be read (a truncated array file, garbage metadata, a missing item)
is *damaged*: `restore_latest_good` reports it and falls back to the newest readable one.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

LAYOUT = "named"


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _paths(tree) -> list[tuple[tuple[str, ...], Any]]:
    """(name path, leaf) of every leaf; a Variable's trailing `value` is left out of the name."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = tuple(_key_name(k) for k in path)
        if len(names) > 1 and names[-1] == "value":
            names = names[:-1]
        out.append((names, x))
    return out


def _named(tree) -> dict:
    """The leaves of `tree` as nested dicts keyed by their path names."""
    out: dict = {}
    for names, x in _paths(tree):
        node = out
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = x
    return out


def _from_named(template, named: dict):
    """The inverse of `_named`: `template`'s structure with the leaves found in `named`."""
    leaves = []
    for names, _ in _paths(template):
        node = named
        for name in names:
            node = node[name]
        leaves.append(node)
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _flat(tree) -> dict:  # the layout before names were stored
    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(tree))}


def fingerprint(tree) -> str:
    """Hash of a tree's leaf paths, shapes and dtypes."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    desc = "".join(
        f"{jax.tree_util.keystr(p)}{np.shape(x)}{np.dtype(getattr(x, 'dtype', type(x)))}"
        for p, x in leaves
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _abstract(tree):
    def spec(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(spec, tree)


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


def complete_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints in `directory` (orbax gives a step its final name
    only once every file is written), ascending; [] if there is none."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(n)
        for n in os.listdir(directory)
        if n.isdigit() and os.path.isdir(os.path.join(directory, n))
    )


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files cannot be read back (the message says which and why)."""


class Checkpointer:
    """Saves and restores the `ITEMS` array trees plus a JSON meta dict under one directory."""

    def __init__(self, directory: str, keep: int = 3, *, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only
        )
        self.manager = self._open()

    def _open(self):
        return ocp.CheckpointManager(
            self.directory, options=self._options, item_names=ITEMS + ("meta",)
        )

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, trees: dict[str, Any], meta: dict) -> None:
        """`trees`: name in ITEMS -> array tree; `meta`: JSON-able dict."""
        meta = dict(
            meta, layout=LAYOUT, fingerprints={name: fingerprint(t) for name, t in trees.items()}
        )
        items = {name: ocp.args.StandardSave(_named(tree)) for name, tree in trees.items()}
        self.manager.save(
            step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items), force=True
        )

    def restore(self, templates: dict[str, Any], step: Optional[int] = None) -> tuple[dict, dict]:
        """Restores the trees named in `templates` (same structure as saved) and the meta dict.

        Raises DamagedCheckpoint when the checkpoint's files cannot be read, ValueError when
        they hold a different model or optimizer."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        where = os.path.join(self.directory, str(step))
        meta = self._read(
            where,
            "meta",
            lambda: self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"],
        )
        if not isinstance(meta, dict) or not isinstance(meta.get("fingerprints"), dict):
            raise DamagedCheckpoint(f"checkpoint {where}: meta holds no fingerprints")
        for name, tree in templates.items():
            if name not in meta["fingerprints"]:
                raise DamagedCheckpoint(f"checkpoint {where}: has no {name!r} item")
            if meta["fingerprints"][name] != fingerprint(tree):
                raise ValueError(
                    f"checkpoint {where}: its {name!r} tree does not match this "
                    "model/optimizer (different config?)"
                )
        named = meta.get("layout") == LAYOUT
        pack = _named if named else _flat
        items = {
            name: ocp.args.StandardRestore(_abstract(pack(tree)))
            for name, tree in templates.items()
        }
        restored = self._read(
            where,
            ", ".join(templates),
            lambda: self.manager.restore(step, args=ocp.args.Composite(**items)),
        )
        trees = {}
        for name, template in templates.items():
            if named:
                trees[name] = _from_named(template, restored[name])
            else:
                trees[name] = jax.tree.unflatten(
                    jax.tree.structure(template),
                    [restored[name][k] for k in sorted(restored[name])],
                )
        return trees, meta

    @staticmethod
    def _read(where: str, what: str, read: Callable):
        """`read()`, with any failure to read the files reported as DamagedCheckpoint."""
        if not os.path.isdir(where):
            raise DamagedCheckpoint(f"checkpoint {where}: no such directory")
        try:
            return read()
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DamagedCheckpoint(
                f"checkpoint {where}: cannot read {what} ({type(e).__name__}: {reason[:300]})"
            ) from e

    def restore_latest_good(
        self, templates: dict[str, Any]
    ) -> tuple[Optional[tuple[int, dict, dict]], list]:
        """((step, trees, meta) of the newest checkpoint that restores, or None if there is no
        checkpoint; [(step, reason), ...] of the damaged ones newer than it).

        Damaged files are left as they are. Raises ValueError naming every checkpoint and
        what is wrong with it if none can be read."""
        damaged = []
        for step in reversed(self.all_steps()):
            try:
                trees, meta = self.restore(templates, step)
            except DamagedCheckpoint as e:
                damaged.append((step, str(e)))
                continue
            return (step, trees, meta), damaged
        if damaged:
            raise ValueError(
                f"no readable checkpoint in {self.directory}: "
                + "; ".join(reason for _, reason in damaged)
            )
        return None, []

    def set_aside(self, step: int, into: str) -> str:
        """Moves checkpoint `step` (unchanged) out of the managed directory into `into`, so
        that new checkpoints neither count it nor overwrite it; returns where it went."""
        self.manager.wait_until_finished()
        os.makedirs(into, exist_ok=True)
        target, n = os.path.join(into, str(step)), 1
        while os.path.exists(target):
            target, n = os.path.join(into, f"{step}-{n}"), n + 1
        os.rename(os.path.join(self.directory, str(step)), target)
        self.manager.close()
        self.manager = self._open()
        return target

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
