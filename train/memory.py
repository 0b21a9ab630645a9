"""How much memory a training run needs, estimated before anything is allocated.

    needed = runtime + state + activations

  runtime      RUNTIME_BYTES: Python, jax and the compiled step (measured: about 1 GB of
               resident memory for the tiny preset, whose arrays are a few MB).
  state        2 (P + O) + P: the parameters (P bytes, float32) and optimizer state (O bytes,
               both from the model's and optimizer's shapes, nothing allocated) as the step's
               inputs and as its outputs, plus one float32 gradient per parameter.
  activations  B * T * per_token, per_token = sum over layers of

                 c_kind * W_layer                  what the backward pass keeps per token
                 + pair_bytes * Hq * T             attention layers: ATTENTION_PAIR_BYTES for
                                                   the pure-JAX (CPU) emulation of the FP8
                                                   kernels, REFERENCE_ARM_PAIR_BYTES for the
                                                   f32 `reference` arm, 0 for the Pallas
                                                   kernels (flash: nothing of size T x T)
               plus LOGIT_BYTES * vocab (logits, softmax and their gradient).
               A scanned layer group (`--scan-layers on`, or `auto` where the unrolled
               step does not fit) holds
               SCAN_ACTIVATIONS[remat] times what the unrolled step holds per token (inside
               a scan XLA cannot fuse away or free the body's residuals), plus
               SCAN_STATE_COPIES parameter-sized copies (the stacked parameters and their
               stacked gradients).

               W_layer is the summed output width of the layer's matmuls (mixer and SwiGLU),
               c_kind the bytes kept per unit of it (KIND_BYTES: the recurrent mixers keep
               their float32 chunk math). For a model that is not a HybridLM every layer
               counts as GENERIC_BYTES per unit of its matmul output width.

The constants were fitted to XLA's own buffer assignment of the compiled step
(`compiled.memory_analysis()`) for the tiny and small presets of every family on the CPU:
within 7% for the small presets (T = 1024 and 2048), within 40% for the tiny ones, whose
activations are a few MB. On a GPU XLA fuses more and keeps less: the unrolled step's
measured peak (`summary.json`'s `peak_device_bytes`, H200) held 0.66-0.86 of the CPU-fitted
activations (`small` at 8 x 8192, `569m` at 8 x 4096 and 4 x 8192, both attention arms;
benchmarks/memory_calibration.py), so a GPU estimate of an unrolled step takes
GPU_UNROLLED_ACTIVATIONS of them. The scanned step keeps its CPU factors on a GPU (no
peak measured there yet). docs/training.md lists what each preset needs.

`check(cfg, build, mesh)` compares the estimate with the memory this process can still get
(the GPU's free memory; on a CPU the host's available memory and any cgroup limit) and
raises `InsufficientMemory` (a ValueError) with a one-line message when it cannot fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import numpy as np

GB = 1e9
RUNTIME_BYTES = 1.0e9
KIND_BYTES = {"gdn": 16.0, "mamba2": 22.0, "kda": 28.0, "attn": 2.0, "mla": 2.0}
GENERIC_BYTES = 16.0
ATTENTION_PAIR_BYTES = 4.66  # the pure-JAX emulation of the FP8 kernels
REFERENCE_ARM_PAIR_BYTES = (
    20.0  # the `reference` arm's f32 XLA attention holds whole score matrices
)
LOGIT_BYTES = 12.0
# The layer scan against the unrolled step, from XLA's buffer assignment on the CPU (`small`
# preset at 1024 and 8192 tokens, per-token slopes): without rematerialisation 1.47x the
# activations; with --remat dots 0.74x (--remat full keeps less still: 0.74 bounds it).
SCAN_ACTIVATIONS = {"none": 1.47, "dots": 0.74, "full": 0.74}
SCAN_STATE_COPIES = 2
# The unrolled step's activations on a GPU against the CPU fit: measured 0.66-0.69 on the
# H200 (2026-12-02); with cuDNN's packed sequences and the fused GDN projections (both
# defaults since) up to 0.86 (`small` at 8 x 8192, `cudnn_bf16`: 35.6 GB; `569m` at 8 x 4096,
# `matched`: 92.1 GB, 0.76; docs/training.md), taken at the top with a margin.
GPU_UNROLLED_ACTIVATIONS = 0.90


class InsufficientMemory(ValueError):
    """The run's estimated memory exceeds what is available."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes a training step needs on one device (all devices together on a CPU host)."""

    state: float
    activations: float
    runtime: float = RUNTIME_BYTES
    remat_hint: str = ""  # for a refusal: a scanned step that rematerialises nothing
    scannable: bool = False  # the model repeats a layer group that --scan-layers could scan

    @property
    def total(self) -> float:
        return self.state + self.activations + self.runtime

    def describe(self) -> str:
        return (
            f"about {size(self.total)} (model and optimizer state {size(self.state)}, "
            f"activations {size(self.activations)}, runtime {size(self.runtime)})"
        )


def size(n_bytes: float) -> str:
    """'1.2 GB', '45 MB'."""
    return f"{n_bytes / GB:.1f} GB" if n_bytes >= 0.95 * GB else f"{n_bytes / 1e6:.0f} MB"


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _matmul_width(module) -> int:
    """Summed output width of the `nnx.Linear` layers under `module`."""
    from flax import nnx

    return int(sum(m.out_features for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Linear)))


def per_token_bytes(model, seq_len: int, *, pair_bytes: float) -> float:
    """Activation bytes per token of a training step (see the module docstring); `pair_bytes`:
    what the attention core holds per (query, key) pair and head."""
    config = getattr(model, "config", None)
    layers = getattr(model, "layers", None)
    if config is None or layers is None or not hasattr(config, "pattern"):
        vocab = getattr(config, "vocab_size", 0) if config is not None else 0
        return GENERIC_BYTES * _matmul_width(model) + LOGIT_BYTES * vocab
    total = LOGIT_BYTES * config.vocab_size
    for kind, layer in zip(config.pattern, layers):
        total += KIND_BYTES[kind] * _matmul_width(layer)
        if kind in ("attn", "mla"):
            total += pair_bytes * config.num_heads * seq_len
    return total


def estimate(cfg, build: Callable, n_devices: int = 1, *, gpu: bool = False) -> Estimate:
    """The memory a step of run `cfg` needs per device (`gpu`) or on the host (all
    `n_devices` CPU devices share it), from abstract shapes only (nothing is allocated)."""
    from flax import nnx

    from train import optim

    model = nnx.eval_shape(lambda: build(cfg))
    params = nnx.state(model, nnx.Param)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    tx = cfg.optimizer.build(
        cfg.steps,
        optim.hidden_matrix_mask(model, params, vocab),
        qk_gain_mask=optim.qk_gain_mask(model, params),
    )
    p_bytes, o_bytes = _nbytes(params), _nbytes(jax.eval_shape(tx.init, params))
    impl = dict(cfg.model.overrides).get("attention_implementation")
    kernels = impl in ("pallas", "triton", "mosaic") or (impl is None and gpu)
    pair = (
        REFERENCE_ARM_PAIR_BYTES
        if cfg.attention == "reference"
        else 0.0
        if kernels
        else ATTENTION_PAIR_BYTES
    )
    tokens = cfg.batch_size * cfg.seq_len
    activations = tokens * per_token_bytes(model, cfg.seq_len, pair_bytes=pair)
    state = 2 * (p_bytes + o_bytes) + p_bytes
    hint = ""
    model_config = getattr(model, "config", None)
    if getattr(model_config, "scans_layers", False):
        activations *= SCAN_ACTIVATIONS[model_config.remat]
        state += SCAN_STATE_COPIES * p_bytes
        if model_config.remat == "none":
            ratio = SCAN_ACTIVATIONS["dots"] / SCAN_ACTIVATIONS["none"]
            hint = f", or add --remat dots (about {ratio:.0%} of the activations)"
    elif gpu:
        activations *= GPU_UNROLLED_ACTIVATIONS
    scannable = getattr(model_config, "layer_repeats", 1) > 1
    if gpu:
        return Estimate(state, activations / n_devices, remat_hint=hint, scannable=scannable)
    return Estimate(state * n_devices, activations, remat_hint=hint, scannable=scannable)


def available_bytes() -> tuple[Optional[float], str]:
    """(bytes this process can still allocate, where that number comes from); None if unknown."""
    device = jax.local_devices()[0]
    if device.platform == "gpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return float(
                stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            ), f"free on {device.device_kind}"
        return None, "unknown"
    candidates = []
    meminfo = _meminfo()
    if "MemAvailable" in meminfo:
        candidates.append((meminfo["MemAvailable"], "available host memory"))
    limit = _cgroup_room()
    if limit is not None:
        candidates.append((limit, "left under this container's memory limit"))
    return min(candidates) if candidates else (None, "unknown")


def peak_device_bytes() -> Optional[float]:
    """The most bytes the first local device has held at once in this process (an
    accelerator's allocator reports it; None where it does not, as on a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else float(peak)


def _meminfo() -> dict:
    try:
        with open("/proc/meminfo") as f:
            return {
                line.split(":")[0]: float(line.split()[1]) * 1024 for line in f if line.split()[1:]
            }
    except (OSError, ValueError, IndexError):
        return {}


def _cgroup_room() -> Optional[float]:
    """Bytes left under a cgroup memory limit (v2, then v1), None without a limit."""
    for limit_path, used_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit_path) as f:
                text = f.read().strip()
            with open(used_path) as f:
                used = float(f.read().strip())
        except (OSError, ValueError):
            continue
        if text == "max" or float(text) > 1 << 60:
            return None
        return float(text) - used
    return None


def check(cfg, build: Callable, mesh=None) -> str:
    """Raises InsufficientMemory (one line: what is needed, what is available, what to change)
    when the run cannot fit; otherwise returns a note with the estimate."""
    return _verdict(cfg, _estimate_here(cfg, build, mesh))


def _estimate_here(cfg, build: Callable, mesh) -> Estimate:
    """`estimate` of run `cfg` on this backend, per device of `mesh`."""
    n = mesh.size if mesh is not None else 1
    return estimate(cfg, build, n, gpu=jax.default_backend() == "gpu")


def _verdict(cfg, need: Estimate) -> str:
    """:func:`check`'s note, or its InsufficientMemory, for the estimate `need` of `cfg`."""
    have, where = available_bytes()
    if have is None or need.total <= have:
        return f"memory: needs {need.describe()}" + (f"; {size(have)} {where}" if have else "")
    raise InsufficientMemory(
        f"--batch-size {cfg.batch_size} --seq-len {cfg.seq_len}: the run needs {need.describe()} "
        f"but only {size(have)} is {where}; lower --batch-size or --seq-len (activations grow "
        f"with both){need.remat_hint}, or pass --skip-memory-check to start anyway"
    )


def check_or_remat(cfg, build: Callable, mesh=None):
    """(cfg, note): the layout run `cfg` trains with, checked by :func:`check`.

    ``--scan-layers auto`` (the default, ``cfg.scan_choice``) takes the unrolled step where
    it fits (on an H200 it runs 1.2-1.5x faster than the scanned one, docs/training.md),
    else the scanned layer group. A scanned step whose run did not ask for a --remat policy
    and fits only with --remat dots gets it. The returned cfg says what was chosen, and so
    does the note. Raises InsufficientMemory when no layout fits."""
    unrolled = None  # auto's refusal of the unrolled step, if it tried one
    need = None
    if cfg.scan_choice == "auto":
        flat = _with_overrides(cfg, scan_layers=False)
        need = _estimate_here(flat, build, mesh)
        if need.scannable:  # else there is no layer scan to choose: cfg's step is flat's
            try:
                return flat, _verdict(flat, need)
            except InsufficientMemory as refusal:
                unrolled, cfg, need = refusal, _with_overrides(cfg, scan_layers=True), None
    need = need or _estimate_here(cfg, build, mesh)
    try:
        note = _verdict(cfg, need)
    except InsufficientMemory as refusal:
        if "remat" in dict(cfg.model.overrides) or not need.remat_hint:
            raise _also_unrolled(refusal, unrolled)
        dots = _with_overrides(cfg, remat="dots")
        try:
            note = check(dots, build, mesh)
        except InsufficientMemory as still:
            raise _also_unrolled(
                InsufficientMemory(f"{still} (with --remat dots; without it: {refusal})"), unrolled
            )
        note = (
            f"{note}; --remat dots chosen: without rematerialisation the scanned step needs "
            f"about {size(need.total)} (pass --remat none to insist)"
        )
        cfg = dots
    if unrolled is not None:
        note += (
            "; the scanned layer group chosen (--scan-layers auto): the unrolled step "
            f"does not fit ({unrolled}; pass --scan-layers off to insist)"
        )
    return cfg, note


def _with_overrides(cfg, **overrides):
    return dataclasses.replace(cfg, model=cfg.model.with_overrides(**overrides))


def _also_unrolled(refusal: InsufficientMemory, unrolled) -> InsufficientMemory:
    """`refusal` of the scanned step, with the unrolled step's when auto tried it first."""
    if unrolled is None:
        return refusal
    return InsufficientMemory(
        f"{refusal}; unrolled (--scan-layers auto tried it first): {unrolled}"
    )
