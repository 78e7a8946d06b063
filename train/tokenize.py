"""Text to a token file with a HF tokenizer: `python -m train.data tokenize`.

    python -m train.data tokenize --tokenizer DIR_OR_JSON OUT.npy INPUT...

The tokenizer is a HF `tokenizers` file, `tokenizer.json`, given as the file
or as a directory holding it (a model's directory: `tokenizer_config.json`
beside it names the EOS token). Inputs are read in the order given:

- `.txt`: one document, the whole file (UTF-8), encoded at once (a corpus
  of very large files streams better as `.jsonl` lines);
- `.jsonl`: one document per line, the string under `--text-field`
  (default "text"); blank lines are skipped. Read line by line and encoded
  in batches of documents (`Tokenizer.encode_batch`), so a file of any
  size streams through with one batch in memory.

Each document is encoded as the tokenizer encodes it by default (its
post-processor's special tokens included: Llama's tokenizers begin a
document with BOS) and followed by EOS, unless the encoding already ends
with it (a post-processor that appends EOS, as T5's does). EOS is
`--eos-id`, else the `eos_token` of `tokenizer_config.json` beside
`tokenizer.json`, else the tokenizer's special token `</s>`,
`<|end_of_text|>`, `<|endoftext|>` or `<eos>`; a tokenizer with none of
them is refused with a request for `--eos-id`.

The output is a token file (`train.token_file`: `OUT.npy` of uint16 or
uint32 ids and `OUT.npy.json`, which records the vocabulary size, EOS, the
tokenizer's path and SHA-256); `python -m train --data OUT.npy` trains on
it with the tokenizer's vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
from typing import Iterator, Sequence

import numpy as np

from train import token_file

PROG = "python -m train.data"
SUFFIXES = (".txt", ".jsonl")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
# Documents per encode_batch call, or fewer when they hold BATCH_CHARS
# characters: enough for the tokenizer's threads, and a bounded memory (an
# `Encoding` holds about 100 bytes a token).
BATCH_DOCS = 1024
BATCH_CHARS = 1 << 21


def tokenizer_json(path: str | os.PathLike) -> pathlib.Path:
  """The `tokenizer.json` of `path`: the file itself, or the one in the
  directory `path`.

  Raises:
    FileNotFoundError: neither exists.
  """
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    p = p / "tokenizer.json"
    if not p.is_file():
      raise FileNotFoundError(
          f"--tokenizer {path}: the directory holds no tokenizer.json; give "
          f"a HF tokenizer directory (tokenizer.save_pretrained(DIR) writes "
          f"one) or the path of a tokenizer.json file.")
  elif not p.is_file():
    raise FileNotFoundError(f"--tokenizer {path}: no such file or directory; "
                            f"give a tokenizer.json or a directory holding "
                            f"one.")
  return p


def tokenizer_sha256(path: str | os.PathLike) -> str:
  """The SHA-256 (hex) of `path`'s `tokenizer.json`: what identifies it."""
  return hashlib.sha256(tokenizer_json(path).read_bytes()).hexdigest()


def load_tokenizer(path: str | os.PathLike):
  """Loads `tokenizers.Tokenizer` from `path` (see `tokenizer_json`).

  Raises:
    FileNotFoundError: no `tokenizer.json` at `path`.
    ValueError: the file is not a `tokenizers` tokenizer.
  """
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  file = tokenizer_json(path)
  try:
    return Tokenizer.from_file(os.fspath(file))
  except Exception as e:  # tokenizers raises bare Exceptions on bad JSON.
    raise ValueError(f"--tokenizer {path}: {file} is not a HF tokenizers "
                     f"tokenizer.json ({e}).") from None


def vocab_size(tokenizer) -> int:
  """The number of ids the model must embed: the largest id + 1 (added
  tokens included; ids need not be contiguous)."""
  ids = tokenizer.get_vocab(with_added_tokens=True).values()
  return max(tokenizer.get_vocab_size(with_added_tokens=True),
             max(ids, default=-1) + 1)


def find_eos(tokenizer, path: str | os.PathLike,
             eos_id: int | None = None) -> int:
  """The id that ends each document (the order in the module docstring).

  Raises:
    ValueError: `eos_id` outside the vocabulary, a configured `eos_token`
      the tokenizer lacks, or no EOS found.
  """
  vocab = vocab_size(tokenizer)
  if eos_id is not None:
    if not 0 <= eos_id < vocab:
      raise ValueError(f"--eos-id {eos_id} is outside the tokenizer's "
                       f"vocabulary [0, {vocab}).")
    return eos_id
  config = tokenizer_json(path).parent / "tokenizer_config.json"
  if config.is_file():
    try:
      token = json.loads(config.read_text()).get("eos_token")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError,
            AttributeError) as e:
      raise ValueError(f"{config}: unreadable ({e}); fix it or pass "
                       f"--eos-id.") from None
    if isinstance(token, dict):  # {"content": "</s>", ...}, older files.
      token = token.get("content")
    if token is not None:
      found = tokenizer.token_to_id(token)
      if found is None:
        raise ValueError(f"{config} names eos_token {token!r}, which the "
                         f"tokenizer does not have; pass --eos-id.")
      return found
  special = {t.content: i for i, t in
             tokenizer.get_added_tokens_decoder().items() if t.special}
  for name in EOS_NAMES:
    if name in special:
      return special[name]
  raise ValueError(
      f"--tokenizer {path}: no EOS token found (no eos_token in a "
      f"tokenizer_config.json, no special token among {list(EOS_NAMES)}; "
      f"special tokens: {sorted(special) or 'none'}); pass --eos-id ID, the "
      f"id that separates documents.")


def check_inputs(inputs: Sequence[str | os.PathLike]) -> list[pathlib.Path]:
  """The inputs as paths, each an existing `.txt` or `.jsonl` file.

  Raises:
    FileNotFoundError: an input does not exist.
    ValueError: no inputs, a directory, or another extension.
  """
  if not inputs:
    raise ValueError("no INPUT files; give .txt or .jsonl files.")
  paths = []
  for given in inputs:
    p = pathlib.Path(given).expanduser()
    if not p.exists():
      raise FileNotFoundError(f"input {given}: no such file.")
    if p.is_dir() or p.suffix not in SUFFIXES:
      what = "a directory" if p.is_dir() else f"extension {p.suffix!r}"
      raise ValueError(
          f"input {given}: {what} is not an input this reads; give .txt "
          f"files (one document each) or .jsonl files (one JSON object a "
          f"line with the text under --text-field).")
    paths.append(p)
  return paths


def documents(path: pathlib.Path, text_field: str = "text") -> Iterator[str]:
  """The documents of one input (see the module docstring).

  Raises:
    ValueError: text that is not UTF-8, a line that is not a JSON object
      holding a string under `text_field` (named with its line number).
  """
  if path.suffix == ".txt":
    try:
      yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not UTF-8 text ({e}).") from None
    return
  with open(path, encoding="utf-8") as f:
    try:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not a JSON line ({e}).") from None
        if not isinstance(record, dict) or text_field not in record:
          fields = sorted(record) if isinstance(record, dict) else None
          raise ValueError(
              f"{path}:{n}: no field {text_field!r} (the line's fields: "
              f"{fields if fields is not None else type(record).__name__}); "
              f"name the text's field with --text-field.")
        text = record[text_field]
        if not isinstance(text, str):
          raise ValueError(f"{path}:{n}: field {text_field!r} holds a value "
                           f"of type {type(text).__name__}, not a string; "
                           f"name the text's field with --text-field.")
        yield text
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not UTF-8 text ({e}).") from None


def _batches(paths: list[pathlib.Path], text_field: str) -> Iterator[list[str]]:
  batch, chars = [], 0
  for path in paths:
    for doc in documents(path, text_field):
      batch.append(doc)
      chars += len(doc)
      if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
        yield batch
        batch, chars = [], 0
  if batch:
    yield batch


def tokenize_files(tokenizer: str | os.PathLike, out: str | os.PathLike,
                   inputs: Sequence[str | os.PathLike], *,
                   text_field: str = "text",
                   eos_id: int | None = None) -> dict:
  """Tokenizes `inputs` into the token file `out` (module docstring).

  Args:
    tokenizer: a `tokenizer.json` or a directory holding one.
    out: the `.npy` to write; `out` + ".json" gets the metadata.
    inputs: `.txt` and `.jsonl` files, in order.
    text_field: the text's field in `.jsonl` records.
    eos_id: the document separator; None: the tokenizer's EOS.

  Returns:
    The metadata written to `out` + ".json".

  Raises:
    FileNotFoundError: a missing tokenizer or input.
    ValueError: a bad tokenizer, input, or output name (nothing written).
  """
  out = pathlib.Path(out)
  if out.suffix != ".npy":
    raise ValueError(f"OUT {out}: a token file is a .npy file; name it "
                     f"{out.with_suffix('.npy').name}.")
  paths = check_inputs(inputs)
  tok = load_tokenizer(tokenizer)
  eos = find_eos(tok, tokenizer, eos_id)
  vocab = vocab_size(tok)
  meta = {"eos_id": eos,
          "tokenizer": os.fspath(pathlib.Path(tokenizer).expanduser()
                                 .resolve()),
          "tokenizer_sha256": tokenizer_sha256(tokenizer),
          "inputs": [os.fspath(p.resolve()) for p in paths]}
  # The same ids without the offsets, a fifth faster (measured here).
  encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
  out.parent.mkdir(parents=True, exist_ok=True)
  docs = 0
  with token_file.TokenWriter(out, vocab, meta) as writer:
    for batch in _batches(paths, text_field):
      pieces = []
      for enc in encode(batch):
        pieces.append(np.asarray(enc.ids, np.int64))
        if not enc.ids or enc.ids[-1] != eos:
          pieces.append(np.array([eos], np.int64))
      writer.write(np.concatenate(pieces))
      docs += len(batch)
    if not docs:
      raise ValueError(f"the inputs {[os.fspath(p) for p in paths]} hold no "
                       f"documents (empty .jsonl files).")
    writer.metadata["documents"] = docs
  return json.loads(token_file.sidecar(out).read_text())


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=(
      "Training data tools. tokenize: text to a token file with a HF "
      "tokenizer, for python -m train --data OUT.npy."))
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  t = sub.add_parser("tokenize", help="text (.txt, .jsonl) to a token file",
                     description=__doc__.split("\n\n")[0])
  t.add_argument("--tokenizer", required=True, metavar="PATH",
                 help="tokenizer.json, or a directory holding one")
  t.add_argument("--text-field", default="text", metavar="NAME",
                 help=".jsonl: the field holding each document's text "
                 "(default: text)")
  t.add_argument("--eos-id", type=int, metavar="ID",
                 help="the id that ends each document (default: the "
                 "tokenizer's EOS token)")
  t.add_argument("out", metavar="OUT", help="the token file to write (.npy; "
                 "OUT.json beside it gets the metadata)")
  t.add_argument("inputs", metavar="INPUT", nargs="+",
                 help=".txt files (one document each) or .jsonl files (one "
                 "document a line)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m train.data`; returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    meta = tokenize_files(args.tokenizer, args.out, args.inputs,
                          text_field=args.text_field, eos_id=args.eos_id)
  except (OSError, ValueError) as e:
    print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
    return 2
  print(f"{args.out}: {meta['num_tokens']:,} {meta['dtype']} tokens, "
        f"{meta['documents']:,} documents, vocab {meta['vocab_size']:,}, "
        f"EOS {meta['eos_id']} (metadata: {token_file.sidecar(args.out)})")
  return 0
