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
import os
from typing import Any, Optional, Sequence

from dm_jax.arms import ARM_NAMES as ATTENTION_ARMS
from dm_jax.backends import IMPLEMENTATIONS

DEFAULT_FAMILY = "gdn_gqa"
OPTIMIZERS = ("adamw", "muon")
PACKINGS = ("segments", "concat")
TOKENIZERS = ("byte", "tiktoken")

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
        _check(self.tokenizer in TOKENIZERS, "--tokenizer", f"expected one of {TOKENIZERS}, got {self.tokenizer!r}")
        _check(self.tokenizer != "tiktoken" or bool(self.tiktoken_encoding), "--tiktoken",
               "a tiktoken tokenizer needs an encoding name or file (--tiktoken NAME_OR_PATH)")
        _check(self.packing in PACKINGS, "--packing", f"expected one of {PACKINGS}, got {self.packing!r}")
        _check(0.0 < self.val_fraction < 0.5, "--val-fraction", f"expected in (0, 0.5), got {self.val_fraction}")
        _check(self.source == "builtin" or os.path.exists(self.source), "--data",
               f"no such file or directory: {self.source!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax optimizer: AdamW, or Muon for hidden matrices plus AdamW for the rest."""

    name: str = "adamw"
    learning_rate: float = 3e-3
    adam_lr_ratio: float = 1.0  # Muon runs: AdamW lr = learning_rate * ratio for non-hidden params
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def validate(self) -> None:
        _check(self.name in OPTIMIZERS, "--optimizer", f"expected one of {OPTIMIZERS}, got {self.name!r}")
        _check(self.learning_rate > 0, "--lr", f"must be positive, got {self.learning_rate}")
        _check(self.warmup_steps >= 0, "--warmup", f"must be >= 0, got {self.warmup_steps}")
        _check(self.clip_norm > 0, "--clip-norm", f"must be positive, got {self.clip_norm}")

    def build(self, total_steps: int, hidden_mask):
        """optax transformation; `hidden_mask` is a bool tree, True for Muon's hidden matrices."""
        from train import optim

        return optim.build_optimizer(self, total_steps, hidden_mask)


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

    VOLATILE = ("run_dir", "steps", "log_every", "eval_every", "eval_batches", "probe_every",
                "ckpt_every", "keep_checkpoints", "stop_at", "resume", "init_from",
                "fresh_optimizer", "distributed")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _check(self.steps > 0, "--steps", f"must be positive, got {self.steps}")
        _check(self.batch_size > 0, "--batch-size", f"must be positive, got {self.batch_size}")
        _check(self.seq_len > 1, "--seq-len", f"must be > 1, got {self.seq_len}")
        for flag, every in (("--log-every", self.log_every), ("--eval-every", self.eval_every),
                            ("--probe-every", self.probe_every), ("--ckpt-every", self.ckpt_every)):
            _check(every >= 0, flag, f"must be >= 0 (0 turns it off), got {every}")
        _check(self.keep_checkpoints >= 1, "--keep", f"must be >= 1, got {self.keep_checkpoints}")
        _check(self.model_parallel >= 1, "--model-parallel", f"must be >= 1, got {self.model_parallel}")
        _check(not (self.resume and self.init_from), "--init-from", "cannot be combined with --resume")
        _check(not self.fresh_optimizer or bool(self.init_from), "--fresh-optimizer", "needs --init-from CKPT")
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
        return cls(model=ModelSpec(**model), data=DataConfig(**d.pop("data")),
                   optimizer=OptimizerConfig(**d.pop("optimizer")),
                   **{k: v for k, v in d.items() if k in known})

    def save(self, run_dir: str, model_config=None) -> None:
        """Writes config.json; `model_config` (the built model's config) is stored for reading."""
        payload = {"run_config": self.to_dict(), "model_config": _jsonable(model_config)}
        write_json_atomic(os.path.join(run_dir, "config.json"), payload, indent=2, sort_keys=True)

    @classmethod
    def load(cls, run_dir: str) -> "RunConfig":
        with open(os.path.join(run_dir, "config.json")) as f:
            return cls.from_dict(json.load(f)["run_config"])


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
    a, b = _flatten(saved.compat_dict()), _flatten(new.compat_dict())
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        lines = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diff)
        raise ValueError(f"--run-dir {new.run_dir!r} holds a run with a different config ({lines}); "
                         "use a new --run-dir")


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
    _check(family in models.FAMILIES, "--preset", f"unknown family {family!r}; families: {sorted(models.FAMILIES)}")
    _check(size in models.SIZES, "--preset", f"unknown size {size!r}; sizes: {list(models.SIZES)}")
    return family, size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a hybrid LM with FP8 Delta-Matching attention (defaults: tiny preset, "
                    "built-in data, reference attention on CPU, Pallas kernels on GPU).")
    a = p.add_argument
    a("--preset", default="tiny", help="SIZE for the default family (gdn_gqa) or FAMILY-SIZE, e.g. gdn_mla-small")
    a("--attention", default="matched", choices=ATTENTION_ARMS, help="attention arm")
    a("--attention-implementation", default=None, choices=IMPLEMENTATIONS,
      help="attention backend; default: pallas on GPU, reference elsewhere")
    a("--qk-norm", default=None, choices=("on", "off"), help="override the preset's QK-norm")
    a("--rope", default=None, choices=("on", "off"), help="override the preset's RoPE (off = NoPE)")
    a("--head-dim", type=int, default=None)
    a("--mixer-impl", default=None, choices=("chunked", "naive"),
      help="linear-mixer form; default: chunked (parallel within chunks); naive is the "
           "step-by-step recurrence")
    a("--steps", type=int, default=None, help="total optimizer steps (sets the LR schedule)")
    a("--batch-size", type=int, default=None, help="global batch size in sequences")
    a("--seq-len", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--run-dir", default=None, help="default: runs/<timestamp>-<preset>-<attention>")
    a("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    a("--init-from", default=None, metavar="CKPT", help="start from the weights of a run dir or checkpoint")
    a("--fresh-optimizer", action="store_true", help="with --init-from: new optimizer state and schedule")
    a("--stop-at", type=int, default=None, metavar="STEP", help="checkpoint and stop after STEP")
    a("--optimizer", default="adamw", choices=OPTIMIZERS)
    a("--lr", type=float, default=None, help="peak learning rate")
    a("--adam-lr-ratio", type=float, default=1.0, help="muon: AdamW lr / Muon lr for embeddings, head, gains")
    a("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-norm", type=float, default=1.0)
    a("--data", default="builtin", help="'builtin', a text file, a directory of text files, or tokens (.npy/.bin)")
    a("--tokenizer", default=None, choices=TOKENIZERS, help="default: byte, or tiktoken when --tiktoken is given")
    a("--tiktoken", default=None, metavar="NAME_OR_PATH", help="tiktoken encoding name or .tiktoken file")
    a("--token-dtype", default="uint16", choices=("uint16", "uint32", "int32"), help="dtype of .bin token files")
    a("--eos-id", type=int, default=None, help="document separator id in token files")
    a("--packing", default="segments", choices=PACKINGS)
    a("--val-fraction", type=float, default=0.02)
    a("--log-every", type=int, default=10)
    a("--eval-every", type=int, default=None, help="validation every N steps (0: off)")
    a("--eval-batches", type=int, default=4)
    a("--probe-every", type=int, default=None, help="dS row-sum residual probe every N steps (0: off)")
    a("--ckpt-every", type=int, default=None, help="checkpoint every N steps (0: only at the end)")
    a("--keep", type=int, default=3, help="keep the last K checkpoints")
    a("--model-parallel", type=int, default=1, help="split attention heads over a 'model' mesh axis of this size")
    a("--distributed", action="store_true", help="call jax.distributed.initialize() (several hosts)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Command-line flags -> RunConfig. Bad flags raise SystemExit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _from_args(args)
    except ValueError as e:
        parser.error(str(e))


def _from_args(args) -> RunConfig:
    family, size = split_preset(args.preset)
    defaults = SIZE_DEFAULTS.get(size, SIZE_DEFAULTS["small"])
    steps = args.steps if args.steps is not None else defaults["steps"]
    tokenizer = args.tokenizer or ("tiktoken" if args.tiktoken else "byte")
    data = DataConfig(source=args.data, tokenizer=tokenizer, tiktoken_encoding=args.tiktoken,
                      token_dtype=args.token_dtype, eos_id=args.eos_id, packing=args.packing,
                      val_fraction=args.val_fraction)
    data.validate()
    from train import data as data_lib  # the tokenizer fixes the vocabulary size

    onoff = {"on": True, "off": False, None: None}
    spec = ModelSpec(family, size).with_overrides(
        attention=args.attention, attention_implementation=args.attention_implementation,
        qk_norm=onoff[args.qk_norm], rope=onoff[args.rope], head_dim=args.head_dim,
        mixer_impl=args.mixer_impl or default_mixer_impl(),
        vocab_size=data_lib.vocab_size(data))
    opt = OptimizerConfig(
        name=args.optimizer, learning_rate=args.lr or defaults["learning_rate"],
        adam_lr_ratio=args.adam_lr_ratio,
        warmup_steps=args.warmup if args.warmup is not None else max(1, steps // 10),
        weight_decay=args.weight_decay, clip_norm=args.clip_norm)
    every = lambda v, default: v if v is not None else default  # noqa: E731
    run_dir = args.run_dir or default_run_dir(args.preset, args.attention)
    cfg = RunConfig(
        model=spec, data=data, optimizer=opt, run_dir=run_dir, steps=steps,
        batch_size=args.batch_size or defaults["batch_size"], seq_len=args.seq_len or defaults["seq_len"],
        seed=args.seed, log_every=args.log_every, eval_every=every(args.eval_every, max(1, steps // 3)),
        eval_batches=args.eval_batches, probe_every=every(args.probe_every, max(1, steps // 3)),
        ckpt_every=every(args.ckpt_every, max(1, steps // 3)), keep_checkpoints=args.keep,
        stop_at=args.stop_at, resume=args.resume, init_from=args.init_from,
        fresh_optimizer=args.fresh_optimizer, model_parallel=args.model_parallel,
        distributed=args.distributed)
    try:
        cfg.model_config  # resolve the preset now: a bad override fails before any compute
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"--preset {args.preset}: cannot build the model config: {e}") from e
    return cfg


def default_mixer_impl() -> str:
    return "chunked"


def default_run_dir(preset: str, attention: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{preset}-{attention}")
