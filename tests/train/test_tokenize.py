"""Tokenizing text with a HF tokenizer into token files of any vocabulary
(`train.tokenize`, `train.token_file`), and training on them.

Every tokenizer is made here with `tokenizers` (nothing is downloaded): a
byte-level BPE trained on a few strings, and a word-level vocabulary of
70,000 words, past uint16's 65,536 ids.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from models import preset
from train import build
from train import data
from train import token_file
from train import tokenize
from train.config import TrainConfig

tokenizers = pytest.importorskip(
    "tokenizers", reason="the HF tokenizers library (the [hf] extra) is not "
    "installed")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXTS = ["the quick brown fox jumps over the lazy dog",
         "pack my box with five dozen liquor jugs",
         "héllo wörld, ünïcode survives byte-level BPE",
         "how vexingly quick daft zebras jump"]
BIG_VOCAB = 70_000  # Words w0..w69999, then [UNK] and </s>.


def bpe_dir(tmp_path: pathlib.Path) -> pathlib.Path:
  """A byte-level BPE with <|endoftext|>, saved as DIR/tokenizer.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  d = tmp_path / "bpe"
  d.mkdir()
  tok.save(str(d / "tokenizer.json"))
  return d


def word_json(tmp_path: pathlib.Path, eos: str | None = "</s>") -> pathlib.Path:
  """A word-level tokenizer of 70,000 words (plus [UNK] and `eos`)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {f"w{i}": i for i in range(BIG_VOCAB)}
  vocab["[UNK]"] = BIG_VOCAB
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  if eos is not None:
    tok.add_special_tokens([eos])
  path = tmp_path / f"words-{eos is not None}.json"
  tok.save(str(path))
  return path


def random_words(n_docs: int, n_words: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(f"w{i}" for i in rng.integers(0, BIG_VOCAB, n_words))
          for _ in range(n_docs)]


def write_jsonl(path: pathlib.Path, docs, field: str = "text") -> pathlib.Path:
  path.write_text("".join(json.dumps({field: d, "id": i}) + "\n"
                          for i, d in enumerate(docs)))
  return path


def expected_ids(tokenizer_path, docs, eos: int) -> np.ndarray:
  tok = tokenizers.Tokenizer.from_file(
      str(tokenize.tokenizer_json(tokenizer_path)))
  return np.concatenate([tok.encode(d).ids + [eos] for d in docs])


def test_txt_and_jsonl_give_the_tokenizers_own_ids(tmp_path):
  """`.txt` (a document each) then `.jsonl` (a document a line), in order,
  each followed by EOS: ids equal `Tokenizer.encode`'s; uint16 for a small
  vocabulary; the file memory-maps with `allow_pickle=False`."""
  tok_dir = bpe_dir(tmp_path)
  txt = tmp_path / "a.txt"
  txt.write_text(TEXTS[0] + "\n\nsecond paragraph\n", encoding="utf-8")
  jsonl = write_jsonl(tmp_path / "b.jsonl", TEXTS[1:])
  with open(jsonl, "a") as f:
    f.write("\n")  # A blank line is skipped.
  out = tmp_path / "tokens.npy"
  meta = tokenize.tokenize_files(tok_dir, out, [txt, jsonl])
  eos = tokenizers.Tokenizer.from_file(
      str(tok_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
  want = expected_ids(tok_dir, [txt.read_text()] + TEXTS[1:], eos)
  got = np.load(out, mmap_mode="r", allow_pickle=False)
  assert isinstance(got, np.memmap) and got.dtype == np.uint16
  np.testing.assert_array_equal(got, want)
  assert meta == json.loads(token_file.sidecar(out).read_text())
  assert meta["num_tokens"] == len(want) and meta["documents"] == 4
  assert meta["eos_id"] == eos and meta["vocab_size"] == 320
  assert meta["tokenizer"] == str(tok_dir.resolve())
  corpus = data.load_corpus(out, val_fraction=0.1)
  assert corpus.vocab_size == 320 and corpus.tokenizer == str(tok_dir.resolve())
  assert corpus.max_id == int(want.max())
  np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]),
                                want)


def test_big_vocabulary_is_uint32_and_trains(tmp_path):
  """A 70,002-id vocabulary: uint32 ids above 65,535, read back exactly;
  the trainer takes its vocabulary from the file's metadata, records the
  tokenizer in config.json and trains."""
  tok = word_json(tmp_path)
  docs = random_words(60, 40) + ["w65535 w65536 w69999 unknown"]
  out = tmp_path / "big.npy"
  tokenize.tokenize_files(tok, out, [write_jsonl(tmp_path / "d.jsonl", docs)])
  eos = BIG_VOCAB + 1
  want = expected_ids(tok, docs, eos)
  assert want.max() == eos and (want > 65535).sum() > 10
  got = np.load(out, mmap_mode="r", allow_pickle=False)
  assert got.dtype == np.uint32
  np.testing.assert_array_equal(got, want)

  corpus = data.load_corpus(out)
  assert corpus.vocab_size == BIG_VOCAB + 2 and corpus.max_id == eos
  cfg = TrainConfig(precision="bf16", steps=2, batch_size=2, seq_len=16,
                    eval_every=2, ckpt_every=2, eval_batches=1,
                    diagnostics=False)
  model = build.model_config(cfg, corpus.vocab_size).replace(
      d_model=32, num_layers=1, num_heads=2, d_ff=64)
  assert model.vocab_size == BIG_VOCAB + 2
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  trainer = Trainer(cfg, corpus, model)
  assert trainer.cfg.tokenizer == str(tok.resolve())
  batch = trainer.batcher.batch(0)
  assert batch.max() > 65535  # uint32 ids reach the model unchanged.
  result = trainer.run(tmp_path / "run", progress=False)
  assert np.isfinite(result.final_val_loss)
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["train"]["tokenizer"] == str(tok.resolve())
  assert saved["model"]["vocab_size"] == BIG_VOCAB + 2


def test_ids_outside_the_model_vocabulary_are_refused(tmp_path):
  """The trainer refuses a model (e.g. an imported one) whose vocabulary
  lacks the data's largest id, naming both; a file whose ids exceed its
  own metadata's vocabulary is refused at load."""
  tok = word_json(tmp_path)
  out = tmp_path / "t.npy"
  tokenize.tokenize_files(tok, out, [write_jsonl(tmp_path / "d.jsonl",
                                                 random_words(8, 20))])
  corpus = data.load_corpus(out)
  cfg = TrainConfig(precision="bf16", steps=1, batch_size=2, seq_len=16)
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=rf"token id {BIG_VOCAB + 1} is outside"
                     rf" the model's vocabulary of 65536 ids"):
    Trainer(cfg, corpus, preset("tiny", vocab_size=65536, d_model=32,
                                num_layers=1, num_heads=2, d_ff=64))
  meta = json.loads(token_file.sidecar(out).read_text())
  meta["vocab_size"] = 65537  # Still uint32, but smaller than the ids.
  token_file.sidecar(out).write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=rf"token id {BIG_VOCAB + 1} is outside"
                     rf" the vocabulary of 65537 ids that t.npy.json"):
    data.load_corpus(out)


def test_config_tokenizer_must_be_the_datas(tmp_path):
  """`TrainConfig.tokenizer` is filled from the corpus; one given must be
  the tokenizer that made the data (the same tokenizer.json, however
  named); another is refused."""
  tok_dir = bpe_dir(tmp_path)
  out = tmp_path / "t.npy"
  tokenize.tokenize_files(tok_dir, out, [write_jsonl(tmp_path / "d.jsonl",
                                                     TEXTS * 20)])
  corpus = data.load_corpus(out)
  assert corpus.run_tokenizer(None) == str(tok_dir.resolve())
  same = str(tok_dir / "tokenizer.json")
  assert corpus.run_tokenizer(same) == same
  other = word_json(tmp_path)
  with pytest.raises(ValueError, match="is not the one that made token file"):
    corpus.run_tokenizer(str(other))
  assert data.load_corpus(tmp_path / "d.jsonl").run_tokenizer(None) is None


def test_eos_comes_from_the_config_the_special_tokens_or_the_flag(tmp_path):
  tok_dir = bpe_dir(tmp_path)
  tok = tokenize.load_tokenizer(tok_dir)
  endoftext = tok.token_to_id("<|endoftext|>")
  assert tokenize.find_eos(tok, tok_dir) == endoftext
  assert tokenize.find_eos(tok, tok_dir, eos_id=5) == 5
  with pytest.raises(ValueError, match=r"--eos-id 320 is outside"):
    tokenize.find_eos(tok, tok_dir, eos_id=320)
  (tok_dir / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<|endoftext|>"}}))
  assert tokenize.find_eos(tok, tok_dir / "tokenizer.json") == endoftext
  (tok_dir / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|eot_id|>"}))
  with pytest.raises(ValueError, match=r"eos_token '<\|eot_id\|>', which the "
                     r"tokenizer does not have; pass --eos-id"):
    tokenize.find_eos(tok, tok_dir)
  bare = word_json(tmp_path, eos=None)
  with pytest.raises(ValueError, match=r"no EOS token found .* pass --eos-id"):
    tokenize.tokenize_files(bare, tmp_path / "x.npy",
                            [write_jsonl(tmp_path / "d.jsonl", ["w1"])])
  assert not (tmp_path / "x.npy").exists()
  meta = tokenize.tokenize_files(bare, tmp_path / "x.npy",
                                 [tmp_path / "d.jsonl"], eos_id=7)
  np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), [1, 7])
  assert meta["eos_id"] == 7


def test_post_processor_special_tokens_are_kept_and_eos_not_doubled(tmp_path):
  """A post-processor's BOS (Llama's) stays at each document's start; one
  that appends EOS (T5's) gets no second EOS."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4}
  for template, want in (("<s> $A", [0, 3, 4, 1, 0, 4, 1]),
                         ("$A </s>", [3, 4, 1, 4, 1])):
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    path = tmp_path / "tok.json"
    tok.save(str(path))
    tokenize.tokenize_files(path, tmp_path / "t.npy", [write_jsonl(
        tmp_path / "d.jsonl", ["a b", "b"])])
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), want)


def test_old_uint16_bin_still_reads(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 50_000, 5000, dtype=np.uint16)
  data.write_bin(tmp_path / "old.bin", tokens)
  corpus = data.load_corpus(tmp_path / "old.bin")
  assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == "<u2"
  assert corpus.vocab_size == int(tokens.max()) + 1 == corpus.max_id + 1
  assert corpus.tokenizer is None
  np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]),
                                tokens)
  # A .npy written by other tools, without metadata: vocabulary from its ids.
  np.save(tmp_path / "plain.npy", tokens.astype(np.uint32))
  plain = data.load_corpus(tmp_path / "plain.npy")
  assert plain.vocab_size == int(tokens.max()) + 1 and plain.tokenizer is None


def test_every_process_computes_the_same_global_batch(tmp_path, monkeypatch):
  """Under `--distributed` each process memory-maps the whole token file
  and computes the same global batch of each step from `(seed, step)`
  (`train.data`'s docstring); `Trainer.put_batch` then keeps its devices'
  rows. Here: two independent loads (two memmaps, as two processes make),
  one under a faked process index 1 of 2, batch for batch the same."""
  tok = word_json(tmp_path)
  out = tmp_path / "t.npy"
  tokenize.tokenize_files(tok, out, [write_jsonl(tmp_path / "d.jsonl",
                                                 random_words(20, 30))])
  first = data.load_corpus(out)
  import jax  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "process_index", lambda *a: 1)
  monkeypatch.setattr(jax, "process_count", lambda *a: 2)
  second = data.load_corpus(out)
  assert first.train is not second.train
  a, b = (data.Batcher(c.train, batch_size=8, seq_len=16, seed=3)
          for c in (first, second))
  for step in (0, 1, 7, a.n):  # a.n // 8 steps make an epoch: two epochs.
    np.testing.assert_array_equal(a.batch(step), b.batch(step))
  np.testing.assert_array_equal(
      data.eval_batches(first.val, batch_size=4, seq_len=16, num_batches=2),
      data.eval_batches(second.val, batch_size=4, seq_len=16, num_batches=2))


def run_cli(*argv, cwd=ROOT):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
          os.pathsep) if p]))
  return subprocess.run([sys.executable, "-m", "train.data", *map(str, argv)],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=120)


def test_module_command_line(tmp_path):
  tok_dir = bpe_dir(tmp_path)
  jsonl = write_jsonl(tmp_path / "d.jsonl", TEXTS, field="body")
  proc = run_cli("tokenize", "--tokenizer", tok_dir, "--text-field", "body",
                 tmp_path / "t.npy", jsonl)
  assert proc.returncode == 0, proc.stderr
  assert "4 documents, vocab 320" in proc.stdout
  assert len(np.load(tmp_path / "t.npy", allow_pickle=False)) > len(TEXTS)
  proc = run_cli("tokenize", "--tokenizer", tmp_path / "nope", tmp_path /
                 "t.npy", jsonl)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.startswith("python -m train.data tokenize: error: "
                                "--tokenizer ")


@pytest.mark.parametrize("case, fragments", [
    ("missing tokenizer", ["--tokenizer", "no such file or directory"]),
    ("directory without tokenizer.json", ["holds no tokenizer.json"]),
    ("not a tokenizer", ["is not a HF tokenizers tokenizer.json"]),
    ("unknown extension", ["extension '.csv' is not an input",
                           ".txt files", ".jsonl files"]),
    ("missing input", ["input", "no such file"]),
    ("jsonl without the field", ["d.jsonl:2: no field 'text'",
                                 "['body', 'id']", "--text-field"]),
    ("jsonl not JSON", ["bad.jsonl:1: not a JSON line"]),
    ("jsonl text not a string",
     ["num.jsonl:1: field 'text' holds a value of type int"]),
    ("output not .npy", ["a token file is a .npy file; name it t.npy"]),
])
def test_bad_inputs_give_one_clear_line(tmp_path, capsys, case, fragments):
  tok_dir = bpe_dir(tmp_path)
  good = write_jsonl(tmp_path / "d.jsonl", TEXTS[:1])
  with open(good, "a") as f:
    f.write(json.dumps({"body": "x", "id": 1}) + "\n")
  (tmp_path / "empty").mkdir()
  (tmp_path / "junk.json").write_text("{}")
  (tmp_path / "x.csv").write_text("a,b")
  (tmp_path / "bad.jsonl").write_text("{not json\n")
  (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
  tok, out, inputs = tok_dir, tmp_path / "t.npy", [good]
  if case == "missing tokenizer":
    tok = tmp_path / "missing"
  elif case == "directory without tokenizer.json":
    tok = tmp_path / "empty"
  elif case == "not a tokenizer":
    tok = tmp_path / "junk.json"
  elif case == "unknown extension":
    inputs = [tmp_path / "x.csv"]
  elif case == "missing input":
    inputs = [tmp_path / "gone.txt"]
  elif case == "jsonl not JSON":
    inputs = [tmp_path / "bad.jsonl"]
  elif case == "jsonl text not a string":
    inputs = [tmp_path / "num.jsonl"]
  elif case == "output not .npy":
    out = tmp_path / "t.bin"
  assert tokenize.main(["tokenize", "--tokenizer", str(tok), str(out),
                        *map(str, inputs)]) == 2
  std = capsys.readouterr()
  assert std.out == "" and len(std.err.strip().splitlines()) == 1, std.err
  for fragment in fragments:
    assert fragment in std.err
  assert not out.exists() and not token_file.sidecar(out).exists()
  assert not list(tmp_path.glob(".*.tmp"))


def test_stale_or_foreign_token_files_are_refused(tmp_path):
  out = tmp_path / "t.npy"
  with token_file.TokenWriter(out, 300, {"eos_id": 0}) as w:
    w.write(np.arange(100))
  with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 300\)"):
    with token_file.TokenWriter(tmp_path / "u.npy", 300) as w:
      w.write([300])
  assert not (tmp_path / "u.npy").exists()
  np.save(out, np.arange(50, dtype=np.uint16))  # The sidecar says 100 ids.
  with pytest.raises(ValueError, match="the metadata is stale"):
    data.load_corpus(out)
  np.save(out, np.zeros((4, 4), np.uint16))
  with pytest.raises(ValueError, match=r"1-D array .* shape \(4, 4\)"):
    token_file.read_tokens(out)
  np.save(out, np.array([{"a": 1}], dtype=object), allow_pickle=True)
  with pytest.raises(ValueError, match="not a .npy token file"):
    token_file.read_tokens(out)
