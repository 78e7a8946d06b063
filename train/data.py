"""Training data: corpora, a train/validation split, packed batches.

Four sources, all without downloads:

- the default corpus: the Python standard library's own `*.py` files, found at
  run time under `sysconfig.get_paths()["stdlib"]` (installed packages under
  `site-packages`/`dist-packages` excluded), read in sorted path order;
- a user's text file, or a directory of files (every regular file, sorted);
- a memory-mapped token file of any vocabulary: `.npy`, uint16 or uint32 ids
  with their tokenizer's metadata beside them (`train.token_file`; written by
  `python -m train.data tokenize --tokenizer PATH OUT.npy INPUT...`, see
  `train.tokenize`): the corpus takes its vocabulary size and tokenizer
  from there;
- a memory-mapped `.bin`, raw little-endian uint16 token ids without a
  header (see `write_bin`), its vocabulary its largest id + 1.

Text files and directories are tokenized as bytes (vocabulary 256). Documents
are packed into one stream, each followed by `EOS` (byte 0, which does not
occur in text); training sequences are consecutive, non-overlapping windows of
that stream, so a sequence may hold the end of one file and the start of the
next.

The split is by file: a file goes to validation when the CRC32 of its path
relative to the corpus root falls in the lowest `val_fraction` of the range, a
rule that depends only on the file's name (adding files elsewhere does not move
it). A single file, a token file (`.npy`, `.bin`), or a directory whose files
all land on one side is split by position instead: the last `val_fraction` of
the stream.

Shuffling: `Batcher.batch(step)` is a pure function of `(seed, step)` — epoch
`e` visits the windows in the order `default_rng([seed, e]).permutation` —
which is what makes resumed runs bit-identical without saving a data state.

Several processes (`python -m train --distributed`): every process loads the
same `--data` path (on a shared filesystem, or an identical copy on each host),
memory-maps it whole and computes the same global batch of step `s`,
`Batcher.batch(s)` (nothing here depends on the process index). The trainer
then hands each of its devices its rows of that batch (`Trainer.put_batch`: the
sequences split over the mesh's batch axes `data`, `fsdp` and, for MoE,
`expert`; devices along `model` get the same rows), so every process reads the
windows of the whole global batch from its file and keeps its devices' rows;
validation batches likewise. Each process also scans the whole token file once
for its largest id (`Corpus.max_id`).
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

from train import token_file

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
    tokenizer: the path of the tokenizer that made a `.npy` token file (a
      `tokenizer.json`, or a directory holding one); None for bytes.
    tokenizer_sha256: the SHA-256 of that `tokenizer.json`.
    max_id: the largest token id of both streams; None: not scanned yet
      (`check_vocab` scans them).
  """

  train: np.ndarray
  val: np.ndarray
  vocab_size: int
  source: str
  train_files: tuple[str, ...] = ()
  val_files: tuple[str, ...] = ()
  tokenizer: str | None = None
  tokenizer_sha256: str | None = None
  max_id: int | None = None

  def describe(self) -> str:
    files = ""
    if self.train_files:
      files = f", {len(self.train_files)}/{len(self.val_files)} files"
    tokenizer = f", tokenizer {self.tokenizer}" if self.tokenizer else ""
    return (f"{self.source}: {len(self.train):,} train / {len(self.val):,} "
            f"val tokens{files}, vocab {self.vocab_size}{tokenizer}")

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

  def check_vocab(self, vocab_size: int) -> None:
    """Raises unless every token id lies in `[0, vocab_size)`.

    Uses `max_id`, or scans the streams (in chunks: a memmap is not loaded).

    Raises:
      ValueError: naming the largest id, the vocabulary and the fix.
    """
    top = self.max_id
    if top is None:
      top = max(token_file.max_token_id(self.train),
                token_file.max_token_id(self.val))
    if top >= vocab_size:
      raise ValueError(
          f"{self.source}: token id {top} is outside the model's vocabulary "
          f"of {vocab_size} ids (0 to {vocab_size - 1}); tokenize the data "
          f"with the model's tokenizer, or give a model with vocab_size > "
          f"{top}.")

  def run_tokenizer(self, configured: str | None) -> str | None:
    """The tokenizer a run on this corpus records (`TrainConfig.tokenizer`).

    Args:
      configured: the run's `TrainConfig.tokenizer`, or None.

    Returns:
      `configured` if given, else the corpus's tokenizer (None for bytes).

    Raises:
      ValueError: `configured` is not the tokenizer (by the SHA-256 of its
        `tokenizer.json`) that made the corpus's token file.
    """
    if configured is None or self.tokenizer_sha256 is None:
      return configured or self.tokenizer
    # pylint: disable-next=g-import-not-at-top
    from train.tokenize import tokenizer_sha256
    try:
      digest = tokenizer_sha256(configured)
    except OSError as e:
      raise ValueError(f"tokenizer {configured}: {e}") from None
    if digest != self.tokenizer_sha256:
      raise ValueError(
          f"tokenizer {configured} is not the one that made {self.source} "
          f"({self.tokenizer}, whose tokenizer.json has another SHA-256); "
          f"tokenize the data with {configured}, or train with the "
          f"tokenizer the data was made with.")
    return configured


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
    raise ValueError("token ids must lie in [0, 65535] for a uint16 .bin file; "
                     "write larger ids to a .npy token file "
                     "(train.token_file.TokenWriter).")
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


def load_corpus(data: str | os.PathLike | None = None, *,
                val_fraction: float = 0.05) -> Corpus:
  """Loads and splits a corpus.

  Args:
    data: None for the standard-library corpus; a `.npy` or `.bin` token
      file; a text file; or a directory (all regular files below it, hidden
      ones skipped).
    val_fraction: share of files (or of the stream) kept for validation.

  Returns:
    A `Corpus`.

  Raises:
    FileNotFoundError: the path does not exist or the directory has no files.
    ValueError: bad fraction, an empty path, a file or directory without
      text, a malformed `.bin` or `.npy` file, a `.npy` whose ids exceed the
      vocabulary of its metadata.
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
  if path.suffix in (".bin", ".npy"):
    return _token_corpus(path, val_fraction)
  tokens = _pack([path])
  if len(tokens) < 2:
    raise ValueError(f"--data {data}: the file holds no text (empty, or NUL "
                     f"bytes only).")
  train, val = _position_split(tokens, val_fraction)
  return Corpus(train=train, val=val, vocab_size=BYTE_VOCAB,
                source=f"text file {path}")


def _token_corpus(path: pathlib.Path, val_fraction: float) -> Corpus:
  """A `.bin` or `.npy` token file, split by position, scanned once."""
  if path.suffix == ".bin":
    tf = token_file.TokenFile(tokens=read_bin(path))
  else:
    tf = token_file.read_tokens(path)
  top = token_file.max_token_id(tf.tokens)
  if tf.vocab_size is not None and top >= tf.vocab_size:
    raise ValueError(
        f"--data {path}: token id {top} is outside the vocabulary of "
        f"{tf.vocab_size} ids that {token_file.sidecar(path).name} records; "
        f"the file is damaged or the metadata is another file's: tokenize "
        f"again.")
  train, val = _position_split(tf.tokens, val_fraction)
  return Corpus(train=train, val=val,
                vocab_size=tf.vocab_size or max(BYTE_VOCAB, top + 1),
                source=f"token file {path}", tokenizer=tf.tokenizer,
                tokenizer_sha256=tf.tokenizer_sha256, max_id=top)


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


if __name__ == "__main__":
  # `python -m train.data tokenize ...`: the data tools' command line.
  from train.tokenize import main  # pylint: disable=g-import-not-at-top
  sys.exit(main())
