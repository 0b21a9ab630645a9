"""The backend registry and the package structure it relies on: one-way imports, the ops
protocol of every registered module, the names of ``implementation=``, availability messages
and the "pallas" fallback."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

import dm_jax
from dm_jax import backends
from pallas_kernels.fp8_attention import api
from pallas_kernels.fp8_attention.tiles import default_tiles

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_PACKAGES = ("pallas_kernels.fp8_attention.triton", "pallas_kernels.fp8_attention.mosaic_gpu")


def _imports(path: pathlib.Path):
    """(module imported, at module level?) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            yield name, id(node) in top


def _files(package: str):
    return sorted((REPO / package).rglob("*.py"))


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_pallas_kernels_imports_nothing_from_dm_jax_or_train():
    """Statically (every import statement) and at run time (importing every module)."""
    bad = [
        (str(path.relative_to(REPO)), name)
        for path in _files("pallas_kernels")
        for name, _ in _imports(path)
        if _under(name, ("dm_jax", "train"))
    ]
    assert not bad, bad
    modules = [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in _files("pallas_kernels")
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dm_jax', 'train')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_dm_jax_reaches_kernels_only_through_the_registry():
    """Only dm_jax/backends.py names a kernel package, and no module of dm_jax or
    pallas_kernels imports this project's code inside a function (no import cycle to dodge)."""
    for path in _files("dm_jax") + _files("pallas_kernels"):
        in_dm_jax = path.relative_to(REPO).parts[0] == "dm_jax"
        for name, top_level in _imports(path):
            ours = _under(name, ("dm_jax", "pallas_kernels", "train"))
            assert top_level or not ours, (path, name)
            if in_dm_jax and path.name != "backends.py":
                assert not _under(name, KERNEL_PACKAGES), (path, name)
    assert backends._TRITON.startswith(KERNEL_PACKAGES[0])
    assert backends._MOSAIC.startswith(KERNEL_PACKAGES[1])


def test_public_names():
    assert backends.IMPLEMENTATIONS == (
        "pallas", "reference", "triton", "triton_interpret", "mosaic", "mosaic_interpret",
        "pallas_interpret",
    )  # fmt: skip
    assert backends.get("pallas_interpret") is backends.get("triton_interpret")
    assert backends.get("triton").module == backends.get("triton_interpret").module
    # dm_jax.attention is the function; no module of that name shadows it
    assert callable(dm_jax.attention) and not isinstance(dm_jax.attention, types.ModuleType)
    assert not (REPO / "dm_jax" / "attention.py").exists()


@pytest.mark.parametrize("name", list(backends.BACKENDS))
def test_every_loadable_backend_follows_the_ops_protocol(name):
    backend = backends.BACKENDS[name]
    ops, reason = backends._load(backend.module)
    if ops is None:  # an unfinished backend: it must say what it lacks when asked for
        assert name.startswith("mosaic"), reason
        assert "not in this installation" in reason or "of the ops protocol" in reason, reason
        return
    assert api.missing_members(ops) == []
    config = ops.default_config(64, 64)
    assert isinstance(config, ops.Config) and dataclasses.is_dataclass(config)
    spec = api.AttentionSpec(False, "matched", "fp8", 0.125, default_tiles(64, 64))
    shape = (1, 64, 2, 64)
    reason = ops.supported(shape, shape, shape, jnp.float32, spec, config)
    assert reason is None or isinstance(reason, str)


def test_a_missing_backend_folder_is_reported_as_such():
    ops, reason = backends._load("pallas_kernels.fp8_attention.not_a_backend.ops")
    assert ops is None
    assert (
        reason
        == "its kernels (pallas_kernels/fp8_attention/not_a_backend/) are not in this installation"
    )


@pytest.mark.parametrize("name", ["mosaic", "mosaic_interpret", "triton"])
def test_an_unavailable_backend_raises_with_its_reason(name):
    """On a host that cannot run it, asking for a backend names it, says why, and lists the
    implementations this host runs. (Available ones are covered by the kernel suite.)"""
    reason = backends.get(name).unavailable()
    if reason is None:
        assert name in backends.available()
        return
    if name == "mosaic":
        assert reason.startswith("the Mosaic GPU backend needs jax >= 0.11 and a Hopper GPU")
    q = jnp.zeros((1, 16, 1, 32))
    with pytest.raises(NotImplementedError) as err:
        dm_jax.attention(q, q, q, implementation=name)
    message = str(err.value)
    assert message.startswith(f"implementation={name!r}: {reason}")
    assert "'reference'" in message and "'triton_interpret'" in message


def _fake_ops(name, refuse):
    """A stand-in ops module that refuses every call with ``refuse`` (or serves all of them)."""

    @dataclasses.dataclass(frozen=True)
    class FakeConfig:
        pass

    module = types.ModuleType(name)
    module.Config = FakeConfig
    module.default_config = lambda dqk, dv: FakeConfig()
    module.supported = lambda *args: refuse
    module.forward = module.delta = module.backward = module.passes = None
    return module


@pytest.mark.parametrize("refuse", [None, "Dv=48: no wgmma tile"])
def test_pallas_takes_the_first_backend_that_serves_the_call(monkeypatch, caplog, refuse):
    """A stand-in "mosaic" that runs here: "pallas" picks it when it serves the call and
    falls back to "triton" when it refuses, and says which ran (debug log)."""
    name = f"fake_fp8_attention_ops_{refuse is None}"  # the registry caches modules by name
    monkeypatch.setitem(sys.modules, name, _fake_ops(name, refuse))
    fake = backends.Backend("mosaic", name)
    monkeypatch.setitem(backends.BACKENDS, "mosaic", fake)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # triton: runnable "here"
    q = jnp.zeros((1, 64, 2, 48))
    spec = api.AttentionSpec(False, "matched", "fp8", 0.125, default_tiles(48, 48))
    with caplog.at_level("DEBUG", logger="dm_jax.backends"):
        backend, config = backends.resolve(None, q, q, q, spec)
    if refuse is None:
        assert backend is fake and type(config).__name__ == "FakeConfig"
        assert "implementation='pallas' runs 'mosaic'" in caplog.text
    else:
        assert backend.name == "triton" and type(config).__name__ == "TritonConfig"
        assert f"implementation='pallas' runs 'triton'; not 'mosaic': {refuse}" in caplog.text


def test_pallas_with_no_backend_left_lists_every_refusal(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((1, 64, 2, 320))  # no Pallas backend runs head dim 320
    with pytest.raises(NotImplementedError) as err:
        dm_jax.attention(q, q, q, implementation="pallas")
    message = str(err.value)
    assert message.startswith("implementation='pallas': no Pallas backend can run this call")
    assert "not 'mosaic': " in message and "not 'triton': Dqk=320" in message
