"""Byte-level training data: corpora, a train/validation split, packed batches.

Three sources, all without downloads or tokenizer files:

- the default corpus: the Python standard library's own `*.py` files, found at
  run time under `sysconfig.get_paths()["stdlib"]` (installed packages under
  `site-packages`/`dist-packages` excluded), read in sorted path order;
- a user's text file, or a directory of files (every regular file, sorted);
- a memory-mapped token file: `.bin`, raw little-endian uint16 token ids (see
  `write_bin`), for corpora that do not fit in memory.

Text is tokenized as bytes (vocabulary 256). Documents are packed into one
stream, each followed by `EOS` (byte 0, which does not occur in text); training
sequences are consecutive, non-overlapping windows of that stream, so a
sequence may hold the end of one file and the start of the next.

The split is by file: a file goes to validation when the CRC32 of its path
relative to the corpus root falls in the lowest `val_fraction` of the range, a
rule that depends only on the file's name (adding files elsewhere does not move
it). A single file, a `.bin`, or a directory whose files all land on one side
is split by position instead: the last `val_fraction` of the stream.

Shuffling: `Batcher.batch(step)` is a pure function of `(seed, step)` — epoch
`e` visits the windows in the order `default_rng([seed, e]).permutation` —
which is what makes resumed runs bit-identical without saving a data state.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys
import sysconfig
import zlib

import numpy as np

EOS = 0
BYTE_VOCAB = 256
_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenized corpus split into training and validation streams.

  Attributes:
    train: uint16 (or uint8) 1-D token stream for training; may be a memmap.
    val: the validation stream, disjoint from `train`.
    vocab_size: number of token ids the model must embed.
    source: human-readable description of where the tokens came from.
    train_files: relative paths of the training files (empty for `.bin` and
      position-split corpora).
    val_files: relative paths of the validation files.
  """

  train: np.ndarray
  val: np.ndarray
  vocab_size: int
  source: str
  train_files: tuple[str, ...] = ()
  val_files: tuple[str, ...] = ()

  def describe(self) -> str:
    files = ""
    if self.train_files:
      files = f", {len(self.train_files)}/{len(self.val_files)} files"
    return (f"{self.source}: {len(self.train):,} train / {len(self.val):,} "
            f"val tokens{files}, vocab {self.vocab_size}")

  def check_seq_len(self, seq_len: int) -> None:
    """Raises unless both streams hold a sequence of `seq_len` + 1 tokens.

    Raises:
      ValueError: naming the corpus, the sizes of its streams and the fix.
    """
    short = [name for name, stream in (("train", self.train),
                                       ("val", self.val))
             if num_windows(stream, seq_len) < 1]
    if short:
      raise ValueError(
          f"{self.source}: {len(self.train):,} train / {len(self.val):,} val "
          f"tokens: the {' and '.join(short)} "
          f"{'streams hold' if len(short) > 1 else 'stream holds'} fewer than "
          f"the {seq_len + 1} tokens of one sequence (--seq-len {seq_len} plus "
          f"the next-token target); use a smaller --seq-len or more data.")


def stdlib_root() -> pathlib.Path:
  """The directory of this interpreter's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
  """The standard library's `*.py` files in sorted relative-path order."""
  root = stdlib_root() if root is None else root
  files = []
  for path in root.rglob("*.py"):
    rel = path.relative_to(root)
    if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
      continue
    if path.is_file():
      files.append(path)
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_val_file(rel_path: str, val_fraction: float) -> bool:
  """The by-name split rule: CRC32 of the relative path, lowest fraction."""
  return zlib.crc32(rel_path.encode("utf-8")) < val_fraction * 2**32


def _pack(paths: list[pathlib.Path]) -> np.ndarray:
  """Bytes of the files, each followed by EOS, as one uint8 stream."""
  chunks = []
  for p in paths:
    chunks.append(p.read_bytes().replace(b"\0", b""))
    chunks.append(bytes([EOS]))
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _position_split(tokens: np.ndarray, val_fraction: float
                    ) -> tuple[np.ndarray, np.ndarray]:
  n_val = max(1, int(round(len(tokens) * val_fraction)))
  return tokens[:-n_val], tokens[-n_val:]


def _files_corpus(root: pathlib.Path, paths: list[pathlib.Path],
                  val_fraction: float, source: str) -> Corpus:
  rels = [p.relative_to(root).as_posix() for p in paths]
  val_mask = [is_val_file(r, val_fraction) for r in rels]
  if all(val_mask) or not any(val_mask):
    train, val = _position_split(_pack(paths), val_fraction)
    return Corpus(train=train, val=val, vocab_size=BYTE_VOCAB,
                  source=f"{source} (split by position)")
  train_p = [p for p, v in zip(paths, val_mask) if not v]
  val_p = [p for p, v in zip(paths, val_mask) if v]
  return Corpus(
      train=_pack(train_p), val=_pack(val_p), vocab_size=BYTE_VOCAB,
      source=source,
      train_files=tuple(r for r, v in zip(rels, val_mask) if not v),
      val_files=tuple(r for r, v in zip(rels, val_mask) if v))


@functools.lru_cache(maxsize=2)
def stdlib_corpus(val_fraction: float = 0.05) -> Corpus:
  """The default corpus (cached per process: it is read once per run)."""
  root = stdlib_root()
  paths = stdlib_files(root)
  if not paths:
    raise FileNotFoundError(
        f"no *.py files found under the standard library at {root}; pass "
        f"--data with a text file, a directory or a .bin token file.")
  return _files_corpus(root, paths, val_fraction,
                       f"Python {'.'.join(map(str, sys.version_info[:2]))} "
                       f"stdlib ({root})")


def write_bin(path: str | os.PathLike, tokens: np.ndarray) -> None:
  """Writes token ids as raw little-endian uint16, the `.bin` format."""
  tokens = np.asarray(tokens)
  if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
    raise ValueError("token ids must lie in [0, 65535] for a uint16 .bin file.")
  tmp = f"{os.fspath(path)}.tmp"
  tokens.astype("<u2").tofile(tmp)
  os.replace(tmp, path)


def read_bin(path: str | os.PathLike) -> np.ndarray:
  """Memory-maps a `.bin` token file (read-only uint16)."""
  size = os.path.getsize(path)
  if size == 0 or size % 2:
    raise ValueError(
        f"{path}: a .bin token file holds uint16 ids (an even, nonzero number "
        f"of bytes); it has {size} bytes. Write one with "
        f"train.data.write_bin, or give a text file another suffix.")
  return np.memmap(path, dtype="<u2", mode="r")


def _bin_vocab(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
  top = 0
  for i in range(0, len(tokens), chunk):
    top = max(top, int(tokens[i:i + chunk].max()))
  return max(BYTE_VOCAB, top + 1)


def load_corpus(data: str | os.PathLike | None = None, *,
                val_fraction: float = 0.05) -> Corpus:
  """Loads and splits a corpus.

  Args:
    data: None for the standard-library corpus; a `.bin` token file; a text
      file; or a directory (all regular files below it, hidden ones skipped).
    val_fraction: share of files (or of the stream) kept for validation.

  Returns:
    A `Corpus`.

  Raises:
    FileNotFoundError: the path does not exist or the directory has no files.
    ValueError: bad fraction, an empty path, a file or directory without
      text, a malformed `.bin` file.
  """
  if not 0.0 < val_fraction < 0.5:
    raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}.")
  if data is None:
    return stdlib_corpus(val_fraction)
  if not os.fspath(data).strip():
    raise ValueError(f"--data {os.fspath(data)!r} is an empty path; give a "
                     f"text file, a directory or a .bin token file.")
  path = pathlib.Path(data).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"--data {data}: no such file or directory.")
  if path.is_dir():
    paths = sorted(
        (p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).as_posix())
    if not paths:
      raise FileNotFoundError(f"--data {data}: the directory has no files.")
    corpus = _files_corpus(path, paths, val_fraction, f"directory {path}")
    if len(corpus.train) + len(corpus.val) == len(paths):  # EOS tokens only.
      raise ValueError(f"--data {data}: the directory's {len(paths)} files "
                       f"hold no text (empty, or NUL bytes only).")
    return corpus
  if path.suffix == ".bin":
    tokens = read_bin(path)
    train, val = _position_split(tokens, val_fraction)
    return Corpus(train=train, val=val, vocab_size=_bin_vocab(tokens),
                  source=f"token file {path}")
  tokens = _pack([path])
  if len(tokens) < 2:
    raise ValueError(f"--data {data}: the file holds no text (empty, or NUL "
                     f"bytes only).")
  train, val = _position_split(tokens, val_fraction)
  return Corpus(train=train, val=val, vocab_size=BYTE_VOCAB,
                source=f"text file {path}")


def num_windows(stream: np.ndarray, seq_len: int) -> int:
  """How many non-overlapping `seq_len + 1` windows the stream holds."""
  return (len(stream) - 1) // seq_len


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  return np.asarray(stream[idx], dtype=np.int32)


class Batcher:
  """Deterministic packed batches: `batch(step)` depends on `(seed, step)` only.

  Each batch is `[batch_size, seq_len + 1]` int32 token ids; inputs are
  `[:, :-1]`, targets `[:, 1:]`. Window `i` of the stream starts at
  `i * seq_len`; an epoch visits every window once in a seeded order.
  """

  def __init__(self, stream: np.ndarray, *, batch_size: int, seq_len: int,
               seed: int):
    self.stream = stream
    self.batch_size = batch_size
    self.seq_len = seq_len
    self.seed = seed
    self.n = num_windows(stream, seq_len)
    if self.n < 1:
      raise ValueError(
          f"the training stream has {len(stream)} tokens, fewer than one "
          f"sequence of {seq_len + 1}; use a smaller --seq-len or more data.")
    self._perm_epoch = -1
    self._perm = None

  def _order(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
      self._perm_epoch = epoch
    return self._perm

  def batch(self, step: int) -> np.ndarray:
    """The batch consumed by optimizer step `step` (0-based)."""
    first = step * self.batch_size
    windows = np.empty(self.batch_size, dtype=np.int64)
    for j in range(self.batch_size):
      epoch, pos = divmod(first + j, self.n)
      windows[j] = self._order(epoch)[pos]
    return _windows(self.stream, windows * self.seq_len, self.seq_len)


def eval_batches(stream: np.ndarray, *, batch_size: int, seq_len: int,
                 num_batches: int) -> np.ndarray:
  """Fixed validation batches `[num_batches, batch_size, seq_len + 1]`.

  The first windows of the validation stream in order (repeated cyclically if
  the stream is short), the same at every evaluation.
  """
  n = num_windows(stream, seq_len)
  if n < 1:
    raise ValueError(
        f"the validation stream has {len(stream)} tokens, fewer than one "
        f"sequence of {seq_len + 1}; use a smaller --seq-len or more data.")
  starts = (np.arange(num_batches * batch_size) % n) * seq_len
  return _windows(stream, starts, seq_len).reshape(
      num_batches, batch_size, seq_len + 1)
