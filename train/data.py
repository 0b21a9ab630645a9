"""Token data: built-in text (the Python standard library sources), user text or token files.

Everything becomes one flat token stream per split, documents separated by `eos_id`. A
`Batches` object cuts a split into windows of `seq_len + 1` tokens and serves batch `i` as a
pure function of (seed, i): resuming at step s needs only s, and every attention arm sees the
same data order.

Batch layout (numpy, on the host):
  tokens_BT    int32 [B, T]   inputs
  targets_BT   int32 [B, T]   next tokens
  segments_BT  int32 [B, T]   document id per token, from 1 ("segments" packing; all 1 for "concat")
  mask_BT      float32 [B, T] 1 where the target belongs to the same document as the input
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
import zlib
from typing import Iterator, Optional

import numpy as np

BYTE_VOCAB = 256
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".c", ".h", ".html", ".tex", ".csv", "")


class ByteTokenizer:
    """UTF-8 bytes 0..255; id 256 separates documents."""

    vocab_size = BYTE_VOCAB + 1
    eos_id = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode("utf-8", "replace")


class TiktokenTokenizer:
    """A tiktoken BPE given by encoding name (cached locally) or a `.tiktoken` ranks file."""

    def __init__(self, name_or_path: str):
        try:
            import tiktoken
        except ImportError as e:
            raise ValueError(
                "--tiktoken: the tiktoken package is not installed; install the extra with "
                "pip install -e '.[bpe]' (or pip install tiktoken)"
            ) from e
        try:
            if os.path.exists(name_or_path):
                from tiktoken.load import load_tiktoken_bpe

                ranks = load_tiktoken_bpe(name_or_path)
                self._enc = tiktoken.Encoding(
                    name=os.path.basename(name_or_path),
                    mergeable_ranks=ranks,
                    special_tokens={},
                    pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                )
            else:
                self._enc = tiktoken.get_encoding(name_or_path)
        except (ValueError, OSError, KeyError) as e:  # unknown name, no network, a bad ranks file
            reason = (str(e).splitlines() or [""])[0][:160]
            raise ValueError(
                f"--tiktoken {name_or_path!r}: cannot load the encoding "
                f"({type(e).__name__}: {reason})"
            ) from e
        self.eos_id = self._enc.n_vocab
        self.vocab_size = self._enc.n_vocab + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), np.int32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < self.eos_id])


def make_tokenizer(data_cfg):
    if data_cfg.tokenizer == "tiktoken":
        return TiktokenTokenizer(data_cfg.tiktoken_encoding)
    return ByteTokenizer()


def _is_token_file(path: str) -> bool:
    return os.path.isfile(path) and path.endswith((".npy", ".bin"))


VOCAB_MULTIPLE = 64


def vocab_size(data_cfg) -> int:
    """Model vocabulary for this data: the tokenizer's (token files: max id + 1), rounded up to
    a multiple of VOCAB_MULTIPLE for matmul-friendly embedding and head shapes."""
    if _is_token_file(data_cfg.source):
        tokens = _load_token_file(data_cfg)
        top = int(tokens.max()) if tokens.size else 0
        eos = data_cfg.eos_id if data_cfg.eos_id is not None else -1
        n = max(top, eos) + 1
    else:
        n = make_tokenizer(data_cfg).vocab_size
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _load_token_file(data_cfg) -> np.ndarray:
    if data_cfg.source.endswith(".npy"):
        return np.load(data_cfg.source, mmap_mode="r")
    return np.memmap(data_cfg.source, dtype=np.dtype(data_cfg.token_dtype), mode="r")


def builtin_files() -> list[str]:
    """The Python standard library's top-level sources: real code and prose, on every machine."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))


def _text_files(source: str) -> list[str]:
    if source == "builtin":
        return builtin_files()
    if os.path.isfile(source):
        return [source]
    files = []
    for root, _, names in os.walk(source):
        files += [os.path.join(root, n) for n in names if os.path.splitext(n)[1] in TEXT_SUFFIXES]
    if not files:
        raise ValueError(f"--data: no text files under {source!r} (suffixes {TEXT_SUFFIXES})")
    return sorted(files)


def _is_validation(key: str, val_fraction: float) -> bool:
    """Deterministic split by document name (stable across machines and runs)."""
    return (zlib.crc32(key.encode("utf-8")) % 10_000) < val_fraction * 10_000


@dataclasses.dataclass
class Splits:
    train: np.ndarray  # int32 [N] token stream, documents end with eos_id
    val: np.ndarray
    eos_id: Optional[int]
    vocab_size: int
    description: str


def load_splits(data_cfg) -> Splits:
    """Reads and tokenizes the data source into train / validation token streams."""
    if _is_token_file(data_cfg.source):
        tokens = _load_token_file(data_cfg)
        top = max(int(tokens.max()) if tokens.size else 0, data_cfg.eos_id or 0)
        return Splits(
            *_token_split(tokens, data_cfg.val_fraction),
            data_cfg.eos_id,
            top + 1,
            f"{len(tokens):,} tokens from {data_cfg.source}",
        )
    tok = make_tokenizer(data_cfg)
    streams = {False: [], True: []}
    root = data_cfg.source if os.path.isdir(data_cfg.source) else os.path.dirname(data_cfg.source)
    total_bytes = 0
    files = _text_files(data_cfg.source)
    for path in files:
        if data_cfg.source == "builtin" and total_bytes >= data_cfg.max_builtin_bytes:
            break
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read()
        total_bytes += len(text)
        key = (
            os.path.relpath(path, root) if data_cfg.source != "builtin" else os.path.basename(path)
        )
        streams[_is_validation(key, data_cfg.val_fraction)].append(
            np.append(tok.encode(text), np.int32(tok.eos_id))
        )
    join = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
    train, val = join(streams[False]), join(streams[True])
    split = "by document name"
    if not streams[True]:  # no document hashed into validation (few files): split by tokens
        train, val = _token_split(train, data_cfg.val_fraction)
        split = f"the last {data_cfg.val_fraction:.0%} of the tokens"
    name = "Python standard library" if data_cfg.source == "builtin" else data_cfg.source
    return Splits(
        train,
        val,
        tok.eos_id,
        tok.vocab_size,
        f"{name}: {len(files)} files, {total_bytes / 1e6:.1f} MB, {data_cfg.tokenizer} tokens, "
        f"validation: {split}",
    )


def _token_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last `val_fraction` of a token stream (at least one token) is
    validation."""
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def segments_and_mask(window_BL: np.ndarray, eos_id: Optional[int], packing: str):
    """Document ids and loss mask for windows of L = T + 1 tokens.

    A document ends with its eos token (which belongs to it); the next token starts a new
    document. Target t (= token t+1) is masked when it starts a new document.
    """
    B, L = window_BL.shape
    T = L - 1
    if packing == "concat" or eos_id is None:
        return np.ones((B, T), np.int32), np.ones((B, T), np.float32)
    is_end_BL = window_BL == eos_id
    starts_BL = np.concatenate([np.zeros((B, 1), bool), is_end_BL[:, :-1]], axis=1)
    seg_BL = 1 + np.cumsum(starts_BL, axis=1).astype(np.int32)
    mask_BT = (seg_BL[:, 1:] == seg_BL[:, :-1]).astype(np.float32)
    return seg_BL[:, :-1], mask_BT


class Batches:
    """Batch i of a split as a pure function of (seed, i); windows are shuffled per epoch."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        eos_id: Optional[int],
        packing: str,
        shuffle: bool = True,
        name: str = "train",
    ):
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.seed, self.eos_id, self.packing, self.shuffle = seed, eos_id, packing, shuffle
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < batch_size:
            hint = (
                "raise --val-fraction, turn evaluation off (--eval-every 0), "
                if name == "validation"
                else ""
            )
            raise ValueError(
                f"--data: the {name} split has {len(tokens):,} tokens, fewer than one batch "
                f"of {batch_size} x {seq_len + 1}; {hint}lower --batch-size/--seq-len or add data"
            )

    def _window_ids(self, first: int, count: int) -> np.ndarray:
        ids = np.arange(first, first + count)
        if not self.shuffle:
            return ids % self.num_windows
        epoch, pos = ids // self.num_windows, ids % self.num_windows
        out = np.empty(count, np.int64)
        for e in np.unique(epoch):
            perm = np.random.default_rng([self.seed, int(e)]).permutation(self.num_windows)
            out[epoch == e] = perm[pos[epoch == e]]
        return out

    def batch(self, index: int, *, shard: int = 0, num_shards: int = 1) -> dict:
        """Batch `index` (this host's `shard` of it when several hosts feed one global batch)."""
        per = self.B // num_shards
        windows = self._window_ids(index * self.B + shard * per, per)
        window_BL = np.stack(
            [np.asarray(self.tokens[w * self.T : w * self.T + self.T + 1]) for w in windows]
        )
        window_BL = window_BL.astype(np.int32)
        segments_BT, mask_BT = segments_and_mask(window_BL, self.eos_id, self.packing)
        return dict(
            tokens=window_BL[:, :-1], targets=window_BL[:, 1:], segments=segments_BT, mask=mask_BT
        )

    def iterate(self, start: int = 0, **kw) -> Iterator[dict]:
        i = start
        while True:
            yield self.batch(i, **kw)
            i += 1


def make_batches(
    run_config, splits: Splits, *, validation: Optional[bool] = None
) -> tuple[Batches, Optional[Batches]]:
    """(train batches, validation batches) for a RunConfig; validation is unshuffled, and None
    when not wanted (default: when evaluation is off, `eval_every == 0`)."""
    common = dict(
        batch_size=run_config.batch_size,
        seq_len=run_config.seq_len,
        eos_id=splits.eos_id,
        packing=run_config.data.packing,
    )
    train = Batches(splits.train, seed=run_config.seed, name="train", **common)
    if not (bool(run_config.eval_every) if validation is None else validation):
        return train, None
    val = Batches(splits.val, seed=run_config.seed, shuffle=False, name="validation", **common)
    return train, val
