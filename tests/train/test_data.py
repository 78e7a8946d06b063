"""Data pipeline: the default corpus, the split, .bin files, packed batches."""

import numpy as np
import pytest

from train import data


def test_default_corpus_is_the_stdlib_split_by_file():
  files = data.stdlib_files()
  root = data.stdlib_root()
  rels = [p.relative_to(root).as_posix() for p in files]
  assert "os.py" in rels and "json/decoder.py" in rels
  assert rels == sorted(rels)
  assert not any("site-packages" in r for r in rels)

  corpus = data.load_corpus()
  assert corpus.vocab_size == 256
  assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000
  # Disjoint by file, together all files, and the rule is by name.
  assert not set(corpus.train_files) & set(corpus.val_files)
  assert sorted(corpus.train_files + corpus.val_files) == rels
  assert all(data.is_val_file(r, 0.05) for r in corpus.val_files)
  assert 0.01 < len(corpus.val_files) / len(rels) < 0.1
  # The streams are the files' bytes, each followed by EOS, in sorted order.
  first = (root / corpus.train_files[0]).read_bytes()
  assert bytes(corpus.train[:len(first)]) == first
  assert corpus.train[len(first)] == data.EOS
  assert corpus.train.dtype == np.uint8


def test_directory_corpus_split_is_disjoint_and_stable(tmp_path):
  for i in range(60):
    (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n" * 20)
  (tmp_path / ".hidden").write_text("skip me")
  corpus = data.load_corpus(tmp_path, val_fraction=0.2)
  assert corpus.val_files and corpus.train_files
  assert not set(corpus.train_files) & set(corpus.val_files)
  assert len(corpus.train_files) + len(corpus.val_files) == 60
  assert b"skip me" not in bytes(corpus.train) + bytes(corpus.val)
  val_text = bytes(corpus.val).decode()
  for name in corpus.val_files:
    i = int(name[3:5])
    assert f"document {i}\n" in val_text
    assert f"document {i}\n" not in bytes(corpus.train).decode()
  # Adding a file does not move the others.
  (tmp_path / "new.txt").write_text("new")
  again = data.load_corpus(tmp_path, val_fraction=0.2)
  assert set(corpus.val_files) <= set(again.val_files)


def test_text_file_is_split_by_position(tmp_path):
  path = tmp_path / "book.txt"
  text = "".join(f"line {i}\n" for i in range(2000))
  path.write_text(text)
  corpus = data.load_corpus(path, val_fraction=0.1)
  joined = bytes(corpus.train) + bytes(corpus.val)
  assert joined == text.encode() + bytes([data.EOS])
  assert abs(len(corpus.val) - 0.1 * len(joined)) <= 1


def test_bin_round_trip_is_memory_mapped(tmp_path):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50_000, size=10_000, dtype=np.uint16)
  path = tmp_path / "tokens.bin"
  data.write_bin(path, tokens)
  assert path.stat().st_size == 2 * tokens.size
  back = data.read_bin(path)
  assert isinstance(back, np.memmap)
  np.testing.assert_array_equal(back, tokens)
  corpus = data.load_corpus(path, val_fraction=0.1)
  np.testing.assert_array_equal(
      np.concatenate([corpus.train, corpus.val]), tokens)
  assert corpus.vocab_size == int(tokens.max()) + 1
  batch = data.Batcher(corpus.train, batch_size=4, seq_len=16,
                       seed=0).batch(0)
  assert batch.dtype == np.int32 and batch.max() > 255


def test_bad_paths_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file"):
    data.load_corpus(tmp_path / "missing.txt")
  with pytest.raises(FileNotFoundError, match="no files"):
    data.load_corpus(tmp_path)
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"abc")
  with pytest.raises(ValueError, match="uint16"):
    data.load_corpus(odd)
  with pytest.raises(ValueError, match="0, 65535"):
    data.write_bin(tmp_path / "x.bin", np.array([70_000]))


def test_batches_are_packed_windows_in_a_seeded_order():
  stream = np.arange(1000, dtype=np.uint16)
  b = data.Batcher(stream, batch_size=9, seq_len=10, seed=3)
  assert b.n == 99
  starts = []
  for step in range(11):  # 99 windows: exactly one epoch.
    batch = b.batch(step)
    assert batch.shape == (9, 11) and batch.dtype == np.int32
    # Consecutive tokens from a window boundary (inputs, then the target).
    np.testing.assert_array_equal(np.diff(batch, axis=1), np.ones((9, 10)))
    assert np.all(batch[:, 0] % 10 == 0)
    starts.extend(batch[:, 0] // 10)
  # The epoch visits every window exactly once, shuffled.
  assert sorted(starts) == list(range(99))
  assert starts != list(range(99))
  # Pure function of (seed, step): a new batcher gives the same batches.
  again = data.Batcher(stream, batch_size=9, seq_len=10, seed=3)
  np.testing.assert_array_equal(again.batch(7), b.batch(7))
  np.testing.assert_array_equal(again.batch(12), b.batch(12))  # 2nd epoch.
  other = data.Batcher(stream, batch_size=9, seq_len=10, seed=4)
  assert not np.array_equal(other.batch(0), again.batch(0))


def test_eval_batches_are_fixed():
  stream = np.arange(300, dtype=np.uint8)
  ev = data.eval_batches(stream, batch_size=2, seq_len=16, num_batches=3)
  assert ev.shape == (3, 2, 17)
  np.testing.assert_array_equal(ev[0, 0], np.arange(17))
  np.testing.assert_array_equal(ev[0, 1], np.arange(16, 33))
  with pytest.raises(ValueError, match="fewer than one sequence"):
    data.eval_batches(stream[:10], batch_size=2, seq_len=16, num_batches=1)
