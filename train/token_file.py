"""The token file: token ids of any vocabulary, memory-mapped for training.

A token file is two files:

- `OUT` (it must end in `.npy`): the ids as one 1-D NumPy array, uint16
  when every id of the vocabulary fits (vocabulary up to 65,536 ids), else
  uint32, little-endian: the standard `.npy` format, which
  `np.load(OUT, mmap_mode="r", allow_pickle=False)` memory-maps (no pickle,
  no code of this project needed to read it);
- `OUT.json` beside it, the metadata: `format` ("nvfp4-jax tokens"),
  `version` (1), `dtype`, `num_tokens`, `vocab_size` (the number of ids the
  model must embed), `eos_id` (the id that ends each document),
  `tokenizer` (the absolute path it was made with: a `tokenizer.json`, or a
  directory holding one and the tokenizer's other files), `tokenizer_sha256`
  (of that `tokenizer.json`), `documents`, `inputs`.

`TokenWriter` streams ids into a token file without holding them (the
`.npy` header, always 128 bytes, is rewritten with the final length at the
end) and renames both files into place only when complete. `read_tokens`
checks a token file against its metadata. A `.npy` without `OUT.json` (ids
written by other tools) is read too: its vocabulary is then its largest id
plus one, at least the 256 bytes. The headerless uint16 `.bin` of
`train.data.write_bin` stays readable there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

FORMAT = "nvfp4-jax tokens"
VERSION = 1
# The `.npy` header of a 1-D array is padded to 128 bytes for every length
# below 10^19 (format 1.0, 64-byte alignment): rewriting it with the final
# length moves no data.
_HEADER_BYTES = 128
_SCAN_CHUNK = 1 << 24  # Ids per step of a scan over a memmap (64 MiB uint32).


def sidecar(path: str | os.PathLike) -> pathlib.Path:
  """The metadata file of token file `path`: `path` + ".json"."""
  return pathlib.Path(f"{os.fspath(path)}.json")


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 where every id of `vocab_size` fits in 16 bits, else uint32."""
  if not 1 <= vocab_size <= 2**32:
    raise ValueError(f"vocab_size {vocab_size} is outside [1, 2^32]; a token "
                     f"file holds uint16 or uint32 ids.")
  return np.dtype("<u2" if vocab_size <= 2**16 else "<u4")


def max_token_id(tokens: np.ndarray, chunk: int = _SCAN_CHUNK) -> int:
  """The largest id of a 1-D stream (-1 if empty), read `chunk` ids at a
  time, so a memmap is scanned without being loaded whole."""
  top = -1
  for i in range(0, len(tokens), chunk):
    top = max(top, int(np.max(tokens[i:i + chunk])))
  return top


@dataclasses.dataclass(frozen=True)
class TokenFile:
  """A token file read by `read_tokens`.

  Attributes:
    tokens: the 1-D ids, a read-only memmap.
    vocab_size: the metadata's vocabulary size; None without `OUT.json`.
    tokenizer: the tokenizer's path from the metadata, or None.
    tokenizer_sha256: the SHA-256 of its `tokenizer.json`, or None.
    eos_id: the id that ends each document, or None.
  """

  tokens: np.ndarray
  vocab_size: int | None = None
  tokenizer: str | None = None
  tokenizer_sha256: str | None = None
  eos_id: int | None = None


def read_tokens(path: str | os.PathLike) -> TokenFile:
  """Memory-maps a `.npy` token file and checks it against `OUT.json`.

  Raises:
    ValueError: not a `.npy` of unsigned 1-D ids, a pickled array, or
      metadata that does not describe this array (another length or dtype:
      a stale `OUT.json`).
  """
  path = pathlib.Path(path)
  try:
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
  except ValueError as e:  # Object arrays, bad headers, truncated data.
    raise ValueError(f"{path}: not a .npy token file ({e}); write one with "
                     f"python -m train.data tokenize.") from None
  if tokens.ndim != 1 or tokens.dtype not in (np.uint8, np.uint16, np.uint32):
    raise ValueError(
        f"{path}: a token file holds a 1-D array of uint8, uint16 or uint32 "
        f"ids; this one is {tokens.dtype} of shape {tokens.shape}. Save "
        f"np.asarray(ids, np.uint32).ravel() instead.")
  meta_path = sidecar(path)
  if not meta_path.exists():
    return TokenFile(tokens=tokens)
  try:
    meta = json.loads(meta_path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{meta_path}: unreadable token-file metadata ({e}); "
                     f"tokenize again, or delete it to read {path.name} "
                     f"without a tokenizer.") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{meta_path}: not token-file metadata (its 'format' is "
                     f"not {FORMAT!r}); tokenize again, or delete it.")
  if meta.get("version") != VERSION:
    raise ValueError(f"{meta_path}: version {meta.get('version')!r}; this "
                     f"library reads version {VERSION}: tokenize again.")
  vocab = meta.get("vocab_size")
  if (not isinstance(vocab, int) or isinstance(vocab, bool)
      or token_dtype(vocab) != tokens.dtype
      or meta.get("num_tokens") != len(tokens)):
    raise ValueError(
        f"{meta_path} describes {meta.get('num_tokens')!r} {meta.get('dtype')}"
        f" ids of vocabulary {vocab!r}, but {path.name} holds {len(tokens)} "
        f"{tokens.dtype} ids: the metadata is stale; tokenize again.")
  return TokenFile(tokens=tokens, vocab_size=vocab,
                   tokenizer=meta.get("tokenizer"),
                   tokenizer_sha256=meta.get("tokenizer_sha256"),
                   eos_id=meta.get("eos_id"))


class TokenWriter:
  """Streams ids into a token file; `close` completes it, atomically.

  Use as a context manager: on an exception nothing is left at `path` (an
  older file there is kept). Ids are checked against `vocab_size` as they
  come.

  Args:
    path: the `.npy` file to write (`path` + ".json" beside it).
    vocab_size: the tokenizer's number of ids; sets the dtype.
    metadata: more fields for `OUT.json` (tokenizer, eos_id, ...).

  Raises:
    ValueError: `path` does not end in `.npy`; `write` of ids outside
      `[0, vocab_size)`.
  """

  def __init__(self, path: str | os.PathLike, vocab_size: int,
               metadata: dict | None = None):
    self.path = pathlib.Path(path)
    if self.path.suffix != ".npy":
      raise ValueError(
          f"{self.path}: a token file is a .npy file; name it "
          f"{self.path.with_suffix('.npy').name}.")
    self.vocab_size = vocab_size
    self.dtype = token_dtype(vocab_size)
    self.metadata = dict(metadata or {})
    self.num_tokens = 0
    self._tmp = self.path.with_name(f".{self.path.name}.tmp")
    self._file = open(self._tmp, "wb")  # pylint: disable=consider-using-with
    self._write_header()

  def _write_header(self) -> None:
    self._file.seek(0)
    np.lib.format.write_array_header_1_0(self._file, {
        "descr": self.dtype.str, "fortran_order": False,
        "shape": (self.num_tokens,)})
    if self._file.tell() != _HEADER_BYTES:
      raise RuntimeError(f"the .npy header took {self._file.tell()} bytes, "
                         f"not {_HEADER_BYTES}: numpy changed its format.")

  def write(self, ids) -> None:
    """Appends `ids` (a 1-D sequence of ints)."""
    ids = np.asarray(ids)
    if ids.size == 0:
      return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= self.vocab_size:
      raise ValueError(
          f"token id {hi if hi >= self.vocab_size else lo} is outside the "
          f"vocabulary [0, {self.vocab_size}) of {self.path.name}.")
    self._file.write(ids.astype(self.dtype).tobytes())
    self.num_tokens += ids.size

  def close(self) -> None:
    """Writes the final header and `OUT.json`; renames both into place."""
    self._file.seek(0, os.SEEK_END)
    self._write_header()
    self._file.close()
    meta = {"format": FORMAT, "version": VERSION,
            "dtype": self.dtype.name, "num_tokens": self.num_tokens,
            "vocab_size": self.vocab_size, **self.metadata}
    meta_tmp = self._tmp.with_suffix(".json.tmp")
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(self._tmp, self.path)
    os.replace(meta_tmp, sidecar(self.path))

  def abort(self) -> None:
    """Closes and deletes the partial file."""
    self._file.close()
    self._tmp.unlink(missing_ok=True)

  def __enter__(self) -> "TokenWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()
