"""Several devices: a ('data', 'model') mesh, batch sharding, and per-shard loss/gradients.

Data parallel: the batch is split over the 'data' axis with `NamedSharding`, parameters are
replicated, and the loss and its gradients are computed per shard inside `jax.shard_map`
(so the attention kernel, a custom call, only ever sees its local shard) and summed with
`psum`. With `--model-parallel M` the mesh gets a 'model' axis of size M: hidden matrices
are sharded over it (heads of the attention projections split across devices) and XLA
partitions the computation inside each data shard.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"


def initialize_distributed() -> None:
    """`jax.distributed.initialize()` for several hosts (arguments from the environment)."""
    jax.distributed.initialize()


def make_mesh(model_parallel: int = 1) -> Mesh:
    devices = np.asarray(jax.devices())
    if devices.size % model_parallel:
        raise ValueError(
            f"--model-parallel {model_parallel}: does not divide the {devices.size} devices"
        )
    return Mesh(devices.reshape(-1, model_parallel), (DATA, MODEL))


def data_size(mesh: Mesh) -> int:
    return mesh.shape[DATA]


def check_batch(batch_size: int, mesh: Mesh) -> None:
    n = data_size(mesh)
    if batch_size % n:
        raise ValueError(
            f"--batch-size {batch_size}: must be divisible by the {n} data-parallel devices"
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA))


def param_sharding(mesh: Mesh, x) -> NamedSharding:
    """Replicated, except hidden matrices split over 'model' along their output dimension."""
    m = mesh.shape[MODEL]
    if m > 1 and getattr(x, "ndim", 0) == 2 and x.shape[-1] % m == 0 and min(x.shape) >= 16:
        return NamedSharding(mesh, P(None, MODEL))
    return NamedSharding(mesh, P())


def shard_params(tree, mesh: Mesh):
    return jax.tree.map(lambda x: jax.device_put(x, param_sharding(mesh, x)), tree)


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """Host numpy batch (this process's rows) -> global arrays sharded over 'data'."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def per_shard_sums(sums_fn: Callable, mesh: Mesh) -> Callable:
    """Wraps `sums_fn(params, batch) -> pytree of sums` so each data shard computes its own
    sums (inside shard_map) and the results are summed over the 'data' axis."""
    if mesh.size == 1:
        return sums_fn  # one device: nothing to split or sum
    auto = mesh.shape[MODEL] > 1

    def local(params, batch):
        return jax.lax.psum(sums_fn(params, batch), DATA)

    kw = dict(mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P(), check_vma=False)
    if auto:
        kw["axis_names"] = frozenset({DATA})  # 'model' stays automatic inside each shard
    return jax.shard_map(local, **kw)
