"""Run configuration: frozen dataclasses built from a model preset plus command-line flags.

A `RunConfig` holds everything needed to reproduce a run (model preset and overrides, data,
optimizer, batch shape, seed). It is saved as `config.json` in the run directory; a run
directory written by an incompatible config is refused (`check_compatible`).

    run_config = parse_args(["--preset", "tiny", "--steps", "50"])
    run_config.model_config      # the resolved dm_jax.models.HybridConfig
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
from typing import Any, Optional, Sequence

from dm_jax.arms import ARM_NAMES as ATTENTION_ARMS
from dm_jax.backends import IMPLEMENTATIONS
from dm_jax.baselines import DOCUMENT_MODES, PACKED_MAX_DOCUMENTS
from dm_jax.nn.fp8 import SCALINGS
from dm_jax.nn.recurrence import CHUNK_LOCALS, STATE_PASSES
from dm_jax.models.config import REMAT_POLICIES
from train import xla_flags

DEFAULT_FAMILY = "gdn_gqa"
OPTIMIZERS = ("adamw", "muon")
PACKINGS = ("segments", "concat")
TOKENIZERS = ("byte", "tiktoken")
SCAN_CHOICES = ("auto", "on", "off")  # --scan-layers

# Per-size run defaults (batch, seq_len, steps, lr); the model sizes live in dm_jax.models.
SIZE_DEFAULTS = {
    "tiny": dict(batch_size=8, seq_len=128, steps=400, learning_rate=3e-3),
    "small": dict(batch_size=16, seq_len=2048, steps=500, learning_rate=1e-3),
    "569m": dict(batch_size=32, seq_len=4096, steps=2000, learning_rate=6e-4),
    "1.67b": dict(batch_size=64, seq_len=4096, steps=2000, learning_rate=4e-4),
    "5.29b": dict(batch_size=128, seq_len=4096, steps=2000, learning_rate=3e-4),
}


def _check(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{flag}: {message}")


def _positive(x: float) -> bool:
    return x > 0 and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model: a preset family and size from dm_jax.models plus keyword overrides."""

    family: str = DEFAULT_FAMILY
    size: str = "tiny"
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.family}-{self.size}"

    def build(self):
        """Returns the dm_jax.models.HybridConfig for this spec."""
        from dm_jax import models

        return models.preset(self.family, self.size, **dict(self.overrides))

    def with_overrides(self, **kw) -> "ModelSpec":
        merged = dict(self.overrides)
        merged.update({k: v for k, v in kw.items() if v is not None})
        return dataclasses.replace(self, overrides=tuple(sorted(merged.items())))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they become [B, T] batches.

    source: "builtin" (the Python standard library sources shipped with the interpreter) or a
      path: a text file, a directory of text files, or a pre-tokenized `.npy`/`.bin` file.
    packing: "segments" gives each document its own segment id (attention stays inside a
      document, cross-document targets are masked); "concat" is plain concatenation.
    """

    source: str = "builtin"
    tokenizer: str = "byte"
    tiktoken_encoding: Optional[str] = None  # e.g. "gpt2" or a path to a .tiktoken file
    token_dtype: str = "uint16"  # for raw .bin token files
    eos_id: Optional[int] = None  # document separator id in token files
    packing: str = "segments"
    val_fraction: float = 0.02
    max_builtin_bytes: int = 16_000_000

    def validate(self) -> None:
        _check(
            self.tokenizer in TOKENIZERS,
            "--tokenizer",
            f"expected one of {TOKENIZERS}, got {self.tokenizer!r}",
        )
        _check(
            self.tokenizer != "tiktoken" or bool(self.tiktoken_encoding),
            "--tiktoken",
            "a tiktoken tokenizer needs an encoding name or file (--tiktoken NAME_OR_PATH)",
        )
        _check(
            self.packing in PACKINGS,
            "--packing",
            f"expected one of {PACKINGS}, got {self.packing!r}",
        )
        _check(
            0.0 < self.val_fraction < 0.5,
            "--val-fraction",
            f"expected in (0, 0.5), got {self.val_fraction}",
        )
        _check(
            self.source == "builtin" or os.path.exists(self.source),
            "--data",
            f"no such file or directory: {self.source!r}",
        )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax optimizer: AdamW, or Muon for hidden matrices plus AdamW for the rest."""

    name: str = "adamw"
    learning_rate: float = 3e-3
    adam_lr_ratio: float = 1.0  # Muon runs: AdamW lr = learning_rate * ratio for non-hidden params
    qk_gain_lr_ratio: float = 1.0  # query/key RMSNorm gains: AdamW lr * ratio (a stress setting)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def validate(self) -> None:
        _check(
            self.name in OPTIMIZERS,
            "--optimizer",
            f"expected one of {OPTIMIZERS}, got {self.name!r}",
        )
        _check(
            _positive(self.learning_rate),
            "--lr",
            f"must be a positive number, got {self.learning_rate}",
        )
        _check(
            _positive(self.adam_lr_ratio),
            "--adam-lr-ratio",
            f"must be a positive number, got {self.adam_lr_ratio}",
        )
        _check(
            _positive(self.qk_gain_lr_ratio),
            "--qk-gain-lr-ratio",
            f"must be a positive number, got {self.qk_gain_lr_ratio}",
        )
        _check(self.warmup_steps >= 0, "--warmup", f"must be >= 0, got {self.warmup_steps}")
        _check(
            self.weight_decay >= 0 and math.isfinite(self.weight_decay),
            "--weight-decay",
            f"must be >= 0, got {self.weight_decay}",
        )
        _check(
            _positive(self.clip_norm),
            "--clip-norm",
            f"must be a positive number, got {self.clip_norm}",
        )

    def build(self, total_steps: int, hidden_mask, extensions: tuple = (), qk_gain_mask=None):
        """optax transformation; `hidden_mask` is a bool tree, True for Muon's hidden matrices;
        `extensions` as in `RunConfig.extensions` (the schedule stays continuous across them);
        `qk_gain_mask` (`train.optim.qk_gain_mask`) is needed when `qk_gain_lr_ratio != 1`."""
        from train import optim

        return optim.build_optimizer(self, total_steps, hidden_mask, extensions, qk_gain_mask)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. Fields in `VOLATILE` may change on `--resume`."""

    model: ModelSpec = ModelSpec()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    run_dir: str = ""
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    # Bookkeeping (does not change the trained weights).
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    probe_every: int = 50
    ckpt_every: int = 50
    keep_checkpoints: int = 3
    stop_at: Optional[int] = None  # stop (with a checkpoint) after this step; for preemption
    resume: bool = False
    init_from: Optional[str] = None
    fresh_optimizer: bool = False
    model_parallel: int = 1
    distributed: bool = False
    skip_memory_check: bool = False
    compile_cache: Optional[str] = None  # persistent compilation cache dir, "off", None: default
    xla_gemm: str = xla_flags.DEFAULT_GEMM  # XLA's matmuls: cublas or triton (train/xla_flags.py)
    # --scan-layers: "on", "off", or "auto" (the unrolled step where the memory estimate says
    # it fits, else the scanned one: train.memory.check_or_remat); the model's scan_layers
    # override holds the resolved choice
    scan_choice: str = "auto"
    # ((step, steps_before), ...): on --resume at `step` the run's --steps changed from
    # `steps_before`; the learning-rate schedule continues from its value there.
    extensions: tuple[tuple[int, int], ...] = ()

    VOLATILE = (
        "run_dir",
        "steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "probe_every",
        "ckpt_every",
        "keep_checkpoints",
        "stop_at",
        "resume",
        "init_from",
        "fresh_optimizer",
        "distributed",
        "skip_memory_check",
        "compile_cache",
        "xla_gemm",
        "scan_choice",
        "extensions",
    )
    # Fields that describe one invocation, not the run: --resume never takes them from the
    # saved config.json.
    PER_INVOCATION = (
        "run_dir",
        "resume",
        "stop_at",
        "distributed",
        "skip_memory_check",
        "compile_cache",
        "xla_gemm",
    )
    # Model overrides that change how a step is compiled, not the parameters or the math:
    # a run may be resumed with other values.
    VOLATILE_OVERRIDES = (
        "scan_layers",
        "remat",
        "state_pass",
        "state_scan_unroll",
        "chunk_local",
        "cudnn_documents",
        "fused_projections",
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _check(self.steps > 0, "--steps", f"must be positive, got {self.steps}")
        _check(self.batch_size > 0, "--batch-size", f"must be positive, got {self.batch_size}")
        _check(self.seq_len > 1, "--seq-len", f"must be > 1, got {self.seq_len}")
        _check(self.seed >= 0, "--seed", f"must be >= 0, got {self.seed}")
        _check(
            self.stop_at is None or self.stop_at >= 1,
            "--stop-at",
            f"must be a step >= 1, got {self.stop_at}",
        )
        _check(self.eval_batches >= 1, "--eval-batches", f"must be >= 1, got {self.eval_batches}")
        for flag, every in (
            ("--log-every", self.log_every),
            ("--eval-every", self.eval_every),
            ("--probe-every", self.probe_every),
            ("--ckpt-every", self.ckpt_every),
        ):
            _check(every >= 0, flag, f"must be >= 0 (0 turns it off), got {every}")
        _check(
            self.compile_cache is None or bool(self.compile_cache),
            "--compile-cache",
            "expected a directory or 'off', got an empty string",
        )
        _check(
            self.scan_choice in SCAN_CHOICES,
            "--scan-layers",
            f"expected one of {SCAN_CHOICES}, got {self.scan_choice!r}",
        )
        _check(self.keep_checkpoints >= 1, "--keep", f"must be >= 1, got {self.keep_checkpoints}")
        _check(
            self.model_parallel >= 1, "--model-parallel", f"must be >= 1, got {self.model_parallel}"
        )
        _check(
            not self.fresh_optimizer or bool(self.init_from),
            "--fresh-optimizer",
            "needs --init-from CKPT",
        )
        self.data.validate()
        self.optimizer.validate()

    @functools.cached_property
    def model_config(self):
        """The resolved dm_jax.models.HybridConfig (vocab size taken from the tokenizer)."""
        return self.model.build()

    @property
    def attention(self) -> str:
        return dict(self.model.overrides).get("attention", "matched")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"]["overrides"] = [list(kv) for kv in self.model.overrides]
        return d

    def compat_dict(self) -> dict:
        d = self.to_dict()
        for k in self.VOLATILE:
            d.pop(k, None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = dict(d)
        model = dict(d.pop("model"))
        model["overrides"] = tuple(tuple(kv) for kv in model.get("overrides", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        d["extensions"] = tuple(tuple(e) for e in d.get("extensions", ()))
        return cls(
            model=ModelSpec(**model),
            data=DataConfig(**d.pop("data")),
            optimizer=OptimizerConfig(**d.pop("optimizer")),
            **{k: v for k, v in d.items() if k in known},
        )

    def save(self, run_dir: str, model_config=None) -> None:
        """Writes config.json; `model_config` (the built model's config) is stored for reading."""
        payload = {"run_config": self.to_dict(), "model_config": _jsonable(model_config)}
        write_json_atomic(os.path.join(run_dir, "config.json"), payload, indent=2, sort_keys=True)

    @classmethod
    def load(cls, run_dir: str) -> "RunConfig":
        """The run config saved in `run_dir`; ValueError naming the file if it cannot be read."""
        path = os.path.join(run_dir, "config.json")
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f)["run_config"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: cannot read the run config ({type(e).__name__}: {e})") from e


def write_json_atomic(path: str, payload, **dump_kwargs) -> None:
    """``json.dump`` to ``path`` through a temporary file and a rename: a process stopped
    while writing leaves the previous file, never half of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, **dump_kwargs)
    os.replace(tmp, path)


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def check_compatible(saved: RunConfig, new: RunConfig) -> None:
    """Raises ValueError listing the differing fields if `new` cannot continue `saved`'s run."""
    a, b = _flatten(_compat_tree(saved)), _flatten(_compat_tree(new))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        flags = {
            path: "--" + dest.replace("_", "-")
            for dest, paths in FLAG_FIELDS.items()
            for path in paths
        }
        lines = ", ".join(
            f"{k}: {a.get(k)!r} -> {b.get(k)!r}" + (f" ({flags[k]})" if k in flags else "")
            for k in diff
        )
        raise ValueError(
            f"--run-dir {new.run_dir!r} holds a run with a different config ({lines}); "
            "--resume continues a run with its saved config (drop those flags), "
            "or use a new --run-dir"
        )


def _tree(cfg: RunConfig) -> dict:
    """`cfg.to_dict()` with the model overrides as a dict (one entry per override)."""
    d = cfg.to_dict()
    d["model"]["overrides"] = dict(cfg.model.overrides)
    return d


def _compat_tree(cfg: RunConfig) -> dict:
    d = _tree(cfg)
    for k in cfg.VOLATILE:
        d.pop(k, None)
    for k in cfg.VOLATILE_OVERRIDES:
        d["model"]["overrides"].pop(k, None)
    return d


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.loads(json.dumps(v))
    return out


def split_preset(preset: str) -> tuple[str, str]:
    """'tiny' -> (default family, 'tiny'); 'gdn_mla-small' -> ('gdn_mla', 'small')."""
    from dm_jax import models

    family, _, size = preset.rpartition("-")
    family = family or DEFAULT_FAMILY
    _check(
        family in models.FAMILIES,
        "--preset",
        f"unknown family {family!r}; families: {sorted(models.FAMILIES)}",
    )
    _check(size in models.SIZES, "--preset", f"unknown size {size!r}; sizes: {list(models.SIZES)}")
    return family, size


def _preset_epilog() -> str:
    from dm_jax import models

    rows = [
        f"  {size:<6} {d['batch_size']:>5} {d['seq_len']:>7} {d['steps']:>5} {d['learning_rate']:>8g}"
        for size, d in SIZE_DEFAULTS.items()
    ]
    return "\n".join(
        [
            "presets: --preset SIZE (family gdn_gqa) or FAMILY-SIZE",
            f"  families: {', '.join(models.FAMILIES)}",
            f"  sizes:    {', '.join(models.SIZES)}",
            "per-size defaults (each flag overrides one):",
            "  size   batch seq-len steps       lr",
            *rows,
            "memory each preset needs: README.md, 'Models and training'; the check before the first",
            "step refuses a run that cannot fit (--skip-memory-check turns it off)",
            "",
            "python -m train --resume --run-dir DIR continues DIR with its saved flags; --steps N",
            "extends it (the learning rate continues smoothly to its floor at step N)",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a hybrid LM with FP8 Delta-Matching attention (defaults: tiny preset, "
        "built-in data, reference attention on CPU, Pallas kernels on GPU).",
        epilog=_preset_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a(
        "--preset",
        default="tiny",
        help="SIZE for the default family (gdn_gqa) or FAMILY-SIZE, e.g. "
        "gdn_mla-small; sizes and their defaults are listed below (default: tiny)",
    )
    a("--attention", default="matched", choices=ATTENTION_ARMS, help="attention arm")
    a(
        "--attention-implementation",
        default=None,
        choices=IMPLEMENTATIONS,
        help="attention backend; default: pallas on GPU, reference elsewhere",
    )
    a("--qk-norm", default=None, choices=("on", "off"), help="override the preset's QK-norm")
    a("--rope", default=None, choices=("on", "off"), help="override the preset's RoPE (off = NoPE)")
    a("--head-dim", type=int, default=None)
    a(
        "--fp8-scaling",
        default=None,
        choices=SCALINGS,
        help="scale granularity of the FP8 linear layers (FFN, attention projections); "
        "default: per_token (causal); per_tensor for comparison",
    )
    a(
        "--ffn",
        default=None,
        choices=("fp8", "bf16"),
        help="precision of the SwiGLU FFN matmuls: fp8 (default, the paper's recipe; per-token "
        "current scales, FP8 forward and backward dots) or bf16; a run keeps its choice on "
        "--resume",
    )
    a(
        "--cudnn-documents",
        default=None,
        choices=DOCUMENT_MODES,
        help="how the cudnn_bf16 arm hands packed documents to cuDNN: packed (default: cuDNN's "
        f"packed sequences, where every row holds at most {PACKED_MAX_DOCUMENTS} documents; "
        "the mask otherwise) or mask (a dense [B, 1, T, S] mask, twice cuDNN's time)",
    )
    a(
        "--mixer-impl",
        default=None,
        choices=("chunked", "naive"),
        help="linear-mixer form; default: chunked (parallel within chunks); naive is the "
        "step-by-step recurrence",
    )
    a(
        "--scan-layers",
        default="auto",
        choices=SCAN_CHOICES,
        help="run the repeating layer group as one lax.scan, compiled once (on), or one call "
        "per layer (off: faster steps on an H200, 1.2-1.5x); auto (default): off where the "
        "memory estimate says the step fits, else on; the same parameters and checkpoints "
        "either way",
    )
    a(
        "--state-pass",
        default=None,
        choices=STATE_PASSES,
        help="how the linear mixers carry their state across chunks: sequential (a "
        "lax.scan), associative (a parallel scan), pallas (one kernel per direction) or auto "
        "(default: pallas on a GPU where its kernels take the shapes, else sequential); "
        "the same math (docs/models.md)",
    )
    a(
        "--chunk-local",
        default=None,
        choices=CHUNK_LOCALS,
        help="how the GDN and Mamba-2 mixers form each chunk's own operands (pair decays, "
        "the delta rule's solve): xla (default) or pallas (one kernel per direction, the "
        "[C, C] matrices kept on chip); KDA always uses xla; the same math (docs/models.md)",
    )
    a(
        "--state-scan-unroll",
        type=int,
        default=None,
        help="chunks per loop iteration of the sequential state pass (default 1)",
    )
    a(
        "--fused-projections",
        default=None,
        choices=("on", "off"),
        help="GDN / KDA mixers: the six projections of the input as one matmul and the three "
        "short convolutions as one (default on: 6.9%% more tokens/s at 569m on the H200; the "
        "same parameters and values up to the order of f32 sums)",
    )
    a(
        "--remat",
        default=None,
        choices=tuple(REMAT_POLICIES),
        help="what the backward pass recomputes: none (default), full (each layer group), "
        "dots (keeps matmul outputs only)",
    )
    a(
        "--steps",
        type=int,
        default=None,
        help="total optimizer steps (sets the LR schedule; "
        "default: the preset's); with --resume, a new total extends or shortens the run",
    )
    a(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size in sequences (default: the preset's)",
    )
    a("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    a("--seed", type=int, default=0)
    a("--run-dir", default=None, help="default: runs/<timestamp>-<preset>-<attention>")
    a(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its last good checkpoint, "
        "with its saved config (flags given here must agree with it, except the bookkeeping ones)",
    )
    a(
        "--init-from",
        default=None,
        metavar="CKPT",
        help="start from the weights of a run dir or checkpoint",
    )
    a(
        "--fresh-optimizer",
        action="store_true",
        help="with --init-from: new optimizer state and schedule",
    )
    a("--stop-at", type=int, default=None, metavar="STEP", help="checkpoint and stop after STEP")
    a("--optimizer", default="adamw", choices=OPTIMIZERS)
    a("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    a(
        "--adam-lr-ratio",
        type=float,
        default=1.0,
        help="muon: AdamW lr / Muon lr for embeddings, head, gains",
    )
    a(
        "--qk-gain-lr-ratio",
        type=float,
        default=1.0,
        help="learning rate of the query/key RMSNorm gains / the AdamW rate (a stress "
        "setting for gain-drift experiments; gains never get weight decay)",
    )
    a("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-norm", type=float, default=1.0)
    a(
        "--data",
        default="builtin",
        help="'builtin', a text file, a directory of text files, or tokens (.npy/.bin)",
    )
    a(
        "--tokenizer",
        default=None,
        choices=TOKENIZERS,
        help="default: byte, or tiktoken when --tiktoken is given",
    )
    a(
        "--tiktoken",
        default=None,
        metavar="NAME_OR_PATH",
        help="tiktoken encoding name or .tiktoken file (needs pip install -e '.[bpe]')",
    )
    a(
        "--token-dtype",
        default="uint16",
        choices=("uint16", "uint32", "int32"),
        help="dtype of .bin token files",
    )
    a("--eos-id", type=int, default=None, help="document separator id in token files")
    a("--packing", default="segments", choices=PACKINGS)
    a("--val-fraction", type=float, default=0.02)
    a("--log-every", type=int, default=10)
    a("--eval-every", type=int, default=None, help="validation every N steps (0: off)")
    a("--eval-batches", type=int, default=4)
    a(
        "--probe-every",
        type=int,
        default=None,
        help="dS row-sum residual probe every N steps (0: off)",
    )
    a("--ckpt-every", type=int, default=None, help="checkpoint every N steps (0: only at the end)")
    a("--keep", type=int, default=3, help="keep the last K checkpoints")
    a(
        "--model-parallel",
        type=int,
        default=1,
        help="split attention heads over a 'model' mesh axis of this size",
    )
    a(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (several hosts)",
    )
    a(
        "--skip-memory-check",
        action="store_true",
        help="start even when the memory estimate says the run does not fit",
    )
    a(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="jax's persistent compilation cache: a second start of the same configuration "
        "loads the compiled step (default: $XDG_CACHE_HOME/dm_jax/jax or ~/.cache/dm_jax/jax; "
        "'off' turns it off)",
    )
    a(
        "--xla-gemm",
        default=xla_flags.DEFAULT_GEMM,
        choices=xla_flags.GEMMS,
        help="XLA's matmuls on a GPU: cublas (default; the 569m step compiles in under a "
        "minute) or triton (XLA's Triton GEMMs, autotuned per fusion: minutes); an "
        "--xla_gpu_enable_triton_gemm setting in XLA_FLAGS wins",
    )
    return p


# The RunConfig fields (dotted paths; model overrides by key) that each flag sets. `--resume`
# takes these from the command line only for flags that were given, the rest from config.json.
FLAG_FIELDS = {
    "preset": ("model.family", "model.size"),
    "attention": ("model.overrides.attention",),
    "attention_implementation": ("model.overrides.attention_implementation",),
    "qk_norm": ("model.overrides.qk_norm",),
    "rope": ("model.overrides.rope",),
    "head_dim": ("model.overrides.head_dim",),
    "fp8_scaling": ("model.overrides.fp8_scaling",),
    "ffn": ("model.overrides.ffn",),
    "cudnn_documents": ("model.overrides.cudnn_documents",),
    "mixer_impl": ("model.overrides.mixer_impl",),
    "scan_layers": ("model.overrides.scan_layers", "scan_choice"),
    "remat": ("model.overrides.remat",),
    "state_pass": ("model.overrides.state_pass",),
    "state_scan_unroll": ("model.overrides.state_scan_unroll",),
    "chunk_local": ("model.overrides.chunk_local",),
    "fused_projections": ("model.overrides.fused_projections",),
    "steps": ("steps",),
    "batch_size": ("batch_size",),
    "seq_len": ("seq_len",),
    "seed": ("seed",),
    "run_dir": ("run_dir",),
    "resume": ("resume",),
    "init_from": ("init_from",),
    "fresh_optimizer": ("fresh_optimizer",),
    "stop_at": ("stop_at",),
    "optimizer": ("optimizer.name",),
    "lr": ("optimizer.learning_rate",),
    "adam_lr_ratio": ("optimizer.adam_lr_ratio",),
    "qk_gain_lr_ratio": ("optimizer.qk_gain_lr_ratio",),
    "warmup": ("optimizer.warmup_steps",),
    "weight_decay": ("optimizer.weight_decay",),
    "clip_norm": ("optimizer.clip_norm",),
    "data": ("data.source", "model.overrides.vocab_size"),
    "tokenizer": ("data.tokenizer", "model.overrides.vocab_size"),
    "tiktoken": ("data.tiktoken_encoding", "data.tokenizer", "model.overrides.vocab_size"),
    "token_dtype": ("data.token_dtype", "model.overrides.vocab_size"),
    "eos_id": ("data.eos_id", "model.overrides.vocab_size"),
    "packing": ("data.packing",),
    "val_fraction": ("data.val_fraction",),
    "log_every": ("log_every",),
    "eval_every": ("eval_every",),
    "eval_batches": ("eval_batches",),
    "probe_every": ("probe_every",),
    "ckpt_every": ("ckpt_every",),
    "keep": ("keep_checkpoints",),
    "model_parallel": ("model_parallel",),
    "distributed": ("distributed",),
    "skip_memory_check": ("skip_memory_check",),
    "compile_cache": ("compile_cache",),
    "xla_gemm": ("xla_gemm",),
}


def given_flags(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> set[str]:
    """The destinations of the flags that `argv` names explicitly."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def parse_args(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Command-line flags -> RunConfig. Bad flags raise SystemExit with a message naming the flag.

    With `--resume`, the run's saved config.json supplies every flag not given here."""
    parser = build_parser()
    args = parser.parse_args(argv)  # malformed flags: argparse's usage and error, exit 2
    xla_flags.use_gemm(args.xla_gemm)  # before anything starts jax's backend
    try:
        if not args.resume:
            return _from_args(args)
        return _resume_from_args(args, given_flags(build_parser(), argv))
    except ValueError as e:  # a bad value: one line naming the flag, exit 2
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def _resume_from_args(args, given: set[str]) -> RunConfig:
    """The saved config of `args.run_dir` with the fields of the `given` flags replaced."""
    _check(
        not args.init_from,
        "--init-from",
        "cannot be combined with --resume (the run has its weights)",
    )
    _check(args.run_dir is not None, "--resume", "needs --run-dir DIR, the run to continue")
    _check(
        os.path.isfile(os.path.join(args.run_dir, "config.json")),
        "--resume",
        f"no run to resume in --run-dir {args.run_dir!r} (no config.json)",
    )
    saved = RunConfig.load(args.run_dir)
    if not given & (set(FLAG_FIELDS) - set(RunConfig.PER_INVOCATION)):
        fresh = None  # nothing to take from the flags but the invocation's own fields
    else:
        fresh = _from_args(args)
    merged, new = _flatten(_tree(saved)), _flatten(_tree(fresh)) if fresh else {}
    for dest in given - set(RunConfig.PER_INVOCATION):
        for path in FLAG_FIELDS[dest]:
            if path in new:
                merged[path] = new[path]
            else:
                merged.pop(path, None)  # an override the flag leaves unset
    for name in RunConfig.PER_INVOCATION:
        merged[name] = getattr(args, name) if name in vars(args) else None
    merged["resume"] = True
    return RunConfig.from_dict(_unflatten(merged))


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        *parents, leaf = (
            path.split(".")
            if not path.startswith("model.overrides.")
            else ("model", "overrides", path[len("model.overrides.") :])
        )
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    model = out.setdefault("model", {})
    model["overrides"] = [list(kv) for kv in sorted(model.get("overrides", {}).items())]
    return out


def _from_args(args) -> RunConfig:
    family, size = split_preset(args.preset)
    defaults = SIZE_DEFAULTS.get(size, SIZE_DEFAULTS["small"])
    given = lambda v, default: v if v is not None else default  # noqa: E731  (0 is a value, not "unset")
    steps = given(args.steps, defaults["steps"])
    _check(
        args.head_dim is None or args.head_dim > 0,
        "--head-dim",
        f"must be positive, got {args.head_dim}",
    )
    _check(
        args.state_scan_unroll is None or args.state_scan_unroll >= 1,
        "--state-scan-unroll",
        f"must be at least 1, got {args.state_scan_unroll}",
    )
    tokenizer = args.tokenizer or ("tiktoken" if args.tiktoken else "byte")
    data = DataConfig(
        source=args.data,
        tokenizer=tokenizer,
        tiktoken_encoding=args.tiktoken,
        token_dtype=args.token_dtype,
        eos_id=args.eos_id,
        packing=args.packing,
        val_fraction=args.val_fraction,
    )
    data.validate()
    from train import data as data_lib  # the tokenizer fixes the vocabulary size

    onoff = {"on": True, "off": False, None: None}
    spec = ModelSpec(family, size).with_overrides(
        attention=args.attention,
        attention_implementation=args.attention_implementation,
        qk_norm=onoff[args.qk_norm],
        rope=onoff[args.rope],
        head_dim=args.head_dim,
        fp8_scaling=args.fp8_scaling,
        ffn=args.ffn,
        cudnn_documents=args.cudnn_documents,
        mixer_impl=args.mixer_impl or default_mixer_impl(),
        scan_layers=args.scan_layers == "on",  # "auto" starts unrolled (check_or_remat)
        remat=args.remat,
        state_pass=args.state_pass,
        state_scan_unroll=args.state_scan_unroll,
        chunk_local=args.chunk_local,
        fused_projections=onoff[args.fused_projections],
        vocab_size=data_lib.vocab_size(data),
    )
    opt = OptimizerConfig(
        name=args.optimizer,
        learning_rate=given(args.lr, defaults["learning_rate"]),
        adam_lr_ratio=args.adam_lr_ratio,
        qk_gain_lr_ratio=args.qk_gain_lr_ratio,
        warmup_steps=given(args.warmup, max(1, steps // 10)),
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
    )
    run_dir = args.run_dir or default_run_dir(args.preset, args.attention)
    cfg = RunConfig(
        model=spec,
        data=data,
        optimizer=opt,
        run_dir=run_dir,
        steps=steps,
        batch_size=given(args.batch_size, defaults["batch_size"]),
        seq_len=given(args.seq_len, defaults["seq_len"]),
        seed=args.seed,
        log_every=args.log_every,
        eval_every=given(args.eval_every, max(1, steps // 3)),
        eval_batches=args.eval_batches,
        probe_every=given(args.probe_every, max(1, steps // 3)),
        ckpt_every=given(args.ckpt_every, max(1, steps // 3)),
        keep_checkpoints=args.keep,
        stop_at=args.stop_at,
        resume=args.resume,
        init_from=args.init_from,
        fresh_optimizer=args.fresh_optimizer,
        model_parallel=args.model_parallel,
        distributed=args.distributed,
        skip_memory_check=args.skip_memory_check,
        compile_cache=args.compile_cache,
        xla_gemm=args.xla_gemm,
        scan_choice=args.scan_layers,
    )
    try:
        cfg.model_config  # resolve the preset now: a bad override fails before any compute
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise ValueError(f"--preset {args.preset}: cannot build the model config: {e}") from e
    return cfg


def default_mixer_impl() -> str:
    return "chunked"


def default_run_dir(preset: str, attention: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{preset}-{attention}")
