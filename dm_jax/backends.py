"""The backend registry behind :func:`dm_jax.attention`: names, availability, dispatch.

Every backend is an ops module with the members of
:class:`pallas_kernels.fp8_attention.api.KernelOps` (``Config``, ``default_config``,
``supported``, ``forward``, ``delta``, ``backward``, ``passes``), run either compiled or in
Pallas interpret mode. The names ``implementation=`` takes:

=====================  ===================================================================
``None``               ``"pallas"`` on a GPU, ``"reference"`` elsewhere
``"pallas"``           the first of :data:`PALLAS` (fastest first) that runs here and
                       supports the call; a debug log says which ran and why others did not
``"triton"``           Pallas with the Triton lowering (``pallas_kernels/fp8_attention/triton``)
``"mosaic"``           Pallas with the Mosaic GPU lowering (``.../mosaic_gpu``): jax >= 0.11, Hopper
``"reference"``        the pure-JAX emulation of the same numerics (:mod:`dm_jax.reference`)
``"triton_interpret"``, ``"mosaic_interpret"``  the kernels in interpret mode, on any host
``"pallas_interpret"`` alias of ``"triton_interpret"``
=====================  ===================================================================

This is the only module of ``dm_jax`` that names a kernel package. It imports a backend's
ops module when the backend is first used, not when ``dm_jax`` is imported: a backend needs
lowerings that not every JAX version has (Mosaic GPU: jax >= 0.11), and a backend that
cannot load must not stop the others. Adding a backend: a folder under
``pallas_kernels/fp8_attention/`` and one :class:`Backend` line in :data:`BACKENDS`
(docs/backends.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable, Optional

import jax

from pallas_kernels.fp8_attention.api import (
    AttentionSpec,
    BackwardResult,
    ForwardResult,
    KernelOps,
    missing_members,
)

log = logging.getLogger(__name__)


def _jax_version() -> tuple:
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


def _anywhere() -> Optional[str]:
    return None


def _gpu() -> Optional[str]:
    platform = jax.default_backend()
    return None if platform == "gpu" else f"needs a GPU (this host runs on {platform})"


def _hopper(device) -> bool:
    return str(getattr(device, "compute_capability", "")).startswith("9")


def _mosaic(interpret: bool) -> Callable[[], Optional[str]]:
    """Requirements of the Mosaic GPU backend: jax >= 0.11, and a Hopper GPU unless interpreted."""

    def requires():
        need = "jax >= 0.11" if interpret else "jax >= 0.11 and a Hopper GPU"
        have = f"jax {jax.__version__}"
        ok = _jax_version() >= (0, 11)
        if not interpret:
            device = jax.devices()[0]
            ok = ok and jax.default_backend() == "gpu" and _hopper(device)
            have += f" and {getattr(device, 'device_kind', jax.default_backend())}"
        return None if ok else f"the Mosaic GPU backend needs {need}; this host has {have}"

    return requires


@functools.cache
def _load(module: str):
    """(the ops module, None), or (None, why it cannot be used)."""
    try:
        ops = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):  # the backend's own folder is missing
            folder = module.rsplit(".", 1)[0].replace(".", "/")
            return None, f"its kernels ({folder}/) are not in this installation"
        return None, f"importing {module} failed: {e}"
    missing = missing_members(ops)
    if missing:
        return None, f"{module} lacks {missing} of the ops protocol (api.KernelOps)"
    return ops, None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registry entry: an ops module, run compiled or in Pallas interpret mode.

    ``requires()`` says why this host cannot run it (None when it can).
    """

    name: str
    module: str
    interpret: bool = False
    requires: Callable[[], Optional[str]] = _anywhere

    def unavailable(self) -> Optional[str]:
        """None if this host can run the backend, else why not."""
        return self.requires() or _load(self.module)[1]

    @property
    def ops(self) -> KernelOps:
        """The ops module. Loading it does not check :meth:`unavailable` (lowering for a GPU
        on a host without one is legitimate); :func:`resolve` does."""
        ops, reason = _load(self.module)
        if ops is None:
            raise NotImplementedError(f"implementation={self.name!r}: {reason}")
        return ops

    def default_config(self, head_dim_qk: int, head_dim_v: int):
        return self.ops.default_config(head_dim_qk, head_dim_v)

    def config_mismatch(self, config) -> Optional[str]:
        """None if ``config`` is this backend's launch-config type, else a sentence."""
        want = self.ops.Config
        if isinstance(config, want):
            return None
        return f"config: expected a {want.__name__} for {self.name!r}, got {type(config).__name__}"

    def supported(self, q, k, v, spec: AttentionSpec, config) -> Optional[str]:
        return self.ops.supported(q.shape, k.shape, v.shape, q.dtype, spec, config)

    def forward(self, q, k, v, q_ids, kv_ids, *, spec, config) -> ForwardResult:
        return self.ops.forward(
            q, k, v, q_ids, kv_ids, spec=spec, config=config, interpret=self.interpret
        )

    def delta(self, q, k, v, out, lse, do, q_ids, kv_ids, *, spec, config):
        return self.ops.delta(
            q, k, v, out, lse, do, q_ids, kv_ids, spec=spec, config=config, interpret=self.interpret
        )

    def backward(
        self, q, k, v, out, lse, do, q_ids, kv_ids, *, spec, config, with_stats=False
    ) -> BackwardResult:
        return self.ops.backward(
            q, k, v, out, lse, do, q_ids, kv_ids, spec=spec, config=config,
            interpret=self.interpret, with_stats=with_stats,
        )  # fmt: skip

    def passes(self, q, k, v, do, *, spec, config) -> dict:
        return self.ops.passes(q, k, v, do, spec=spec, config=config, interpret=self.interpret)


_TRITON = "pallas_kernels.fp8_attention.triton.ops"
_MOSAIC = "pallas_kernels.fp8_attention.mosaic_gpu.ops"
BACKENDS = {
    b.name: b
    for b in (
        Backend("reference", "dm_jax.reference_ops"),
        Backend("triton", _TRITON, requires=_gpu),
        Backend("triton_interpret", _TRITON, interpret=True),
        Backend("mosaic", _MOSAIC, requires=_mosaic(interpret=False)),
        Backend("mosaic_interpret", _MOSAIC, interpret=True, requires=_mosaic(interpret=True)),
    )
}
ALIASES = {"pallas_interpret": "triton_interpret"}
PALLAS = ("mosaic", "triton")  # what "pallas" tries, fastest first
IMPLEMENTATIONS = ("pallas",) + tuple(BACKENDS) + tuple(ALIASES)


def default_implementation() -> str:
    """ "pallas" on a GPU, "reference" elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def get(name: str) -> Backend:
    """The backend registered as ``name`` (aliases resolved; not "pallas", which depends on
    the call: see :func:`resolve`)."""
    return BACKENDS[ALIASES.get(name, name)]


def available() -> tuple:
    """Names of the registered backends this host can run."""
    return tuple(name for name, b in BACKENDS.items() if b.unavailable() is None)


def kernel_backends() -> tuple:
    """The Pallas backends this host can run (interpret twins included): what the kernel
    tests run against."""
    return tuple(name for name in available() if name != "reference")


def resolve(
    implementation: Optional[str], q, k, v, spec: AttentionSpec, config=None, *, empty=False
):
    """``(backend, config)`` that run this call; ``config`` None becomes the backend's default.

    Raises NotImplementedError naming ``implementation`` when no backend it names can run the
    call here (with what can), ValueError when ``config`` is another backend's type. An
    ``empty`` call (nothing to compute) skips the backend's shape checks.
    """
    name = ALIASES.get(implementation, implementation) or default_implementation()
    if name == "pallas":
        return _first_pallas(q, k, v, spec, config, empty)
    backend = BACKENDS[name]
    reason = backend.unavailable()
    if reason:
        raise NotImplementedError(f"implementation={implementation!r}: {reason}; {_here()}")
    if config is None:
        config = backend.default_config(q.shape[-1], v.shape[-1])
    mismatch = backend.config_mismatch(config)
    if mismatch:
        raise ValueError(mismatch)
    reason = None if empty else backend.supported(q, k, v, spec, config)
    if reason:
        raise NotImplementedError(f"implementation={implementation!r}: {reason}")
    return backend, config


def _first_pallas(q, k, v, spec, config, empty):
    """The first backend of PALLAS that serves the call (``config`` picks by its type)."""
    refusals = []
    for name in PALLAS:
        backend = BACKENDS[name]
        reason = backend.unavailable()
        if reason is None and config is not None:
            reason = backend.config_mismatch(config)
        if reason is None:
            chosen = (
                config if config is not None else backend.default_config(q.shape[-1], v.shape[-1])
            )
            reason = None if empty else backend.supported(q, k, v, spec, chosen)
        if reason is None:
            log.debug(
                "implementation='pallas' runs %r%s", name, "".join(f"; {r}" for r in refusals)
            )
            return backend, chosen
        refusals.append(f"not {name!r}: {reason}")
    raise NotImplementedError(
        f"implementation='pallas': no Pallas backend can run this call here "
        f"({'; '.join(refusals)}); {_here()}"
    )


def _here() -> str:
    return f"implementations this host can run: {', '.join(map(repr, available()))}"
