"""A sweep of `python -m train` over bad flags, data files and resumes.

Every bad input must end the CLI with status 2 and one line on stderr that
names the argument, the value and the fix (argparse's usage error for a
malformed value): never a Python traceback. Flags are swept with hypothesis
(generated values that each flag's own type refuses, out-of-range integers);
data files and resumes with a table of cases.
"""

import contextlib
import io
import pathlib

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from models import preset
from train import cli
from train import data
from train.config import MAX_SEED
from train.config import MAX_STEPS
from train.config import TrainConfig
from train.loop import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAST = ["--precision", "bf16", "--steps", "1", "--batch-size", "2",
        "--seq-len", "16", "--no-diagnostics", "--no-progress"]


def run_cli(argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = cli.main(argv)
  return status, out.getvalue(), err.getvalue()


def assert_one_line_error(argv, *fragments) -> str:
  """The CLI refuses `argv`: status 2, one `nvfp4-train: error:` line on
  stderr holding every fragment, nothing else."""
  status, _, err = run_cli(argv)
  assert status == 2, err
  assert "Traceback" not in err, err
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("nvfp4-train: error: "), err
  for fragment in fragments:
    assert fragment in lines[0], (fragment, lines[0])
  return lines[0]


# --- Flags -----------------------------------------------------------------

PARSER = cli.build_parser()
OPTIONS = [a for a in PARSER._actions if a.option_strings and a.nargs is None]
TYPED = {a.option_strings[0]: a for a in OPTIONS if a.type is not None}
CHOICES = {a.option_strings[0]: a for a in OPTIONS if a.choices}
# The range each integer flag accepts: an int32 for sizes and counts.
INT_RANGES = {
    "--steps": (1, MAX_STEPS), "--batch-size": (1, MAX_STEPS),
    "--seq-len": (1, MAX_STEPS), "--grad-accum": (1, MAX_STEPS),
    "--eval-every": (1, MAX_STEPS), "--ckpt-every": (1, MAX_STEPS),
    "--late-switch-step": (0, MAX_STEPS), "--seed": (0, MAX_SEED),
}


def test_the_sweep_knows_every_numeric_flag():
  assert set(INT_RANGES) <= set(TYPED)
  assert "--lr" in TYPED and "--precision" in CHOICES


def refused_by(action, text: str) -> bool:
  if action.choices is not None:
    return text not in action.choices
  try:
    action.type(text)
  except Exception:  # pylint: disable=broad-except
    return True
  return False


@hypothesis.given(data=st.data())
def test_any_value_a_flag_refuses_gives_one_line_naming_flag_and_value(data):
  action = data.draw(st.sampled_from(sorted(
      {**TYPED, **CHOICES}.values(), key=lambda a: a.option_strings[0])))
  flag = action.option_strings[0]
  text = data.draw(st.one_of(
      st.text(max_size=12),
      st.integers(-2**70, 2**70).map(str),
      st.floats(allow_nan=True, allow_infinity=True).map(repr),
      st.sampled_from(["", " ", "1e3", "0x10", "1.0", "-0", "NaN", "ten"])))
  hypothesis.assume(refused_by(action, text))
  # `--flag=value`: a value starting with "-" is not taken for a flag.
  assert_one_line_error([f"{flag}={text}"], f"argument {flag}: ",
                        repr(text))


@hypothesis.given(data=st.data())
def test_out_of_range_integers_are_refused_with_the_range(data):
  flag = data.draw(st.sampled_from(sorted(INT_RANGES)))
  low, high = INT_RANGES[flag]
  value = data.draw(st.one_of(st.integers(max_value=low - 1),
                              st.integers(min_value=high + 1)))
  line = assert_one_line_error([f"{flag}={value}"], f"argument {flag}: ",
                               f"got '{value}'")
  assert ("positive integer" in line or ">= 0" in line
          or f"[{low}, {high}]" in line), line


@pytest.mark.parametrize("flag, value, fix", [
    ("--lr", "nan", "a positive finite number"),
    ("--lr", "inf", "a positive finite number"),
    ("--lr", "-1e-3", "a positive finite number"),
    ("--lr", "0", "a positive finite number"),
    ("--steps", "2147483648", "[1, 2147483647]"),
    ("--steps", "1.5", "a positive integer"),
    ("--seed", "-1", f"[0, {MAX_SEED}]"),
    ("--seed", str(2**64), f"[0, {MAX_SEED}]"),
    ("--batch-size", "9" * 30, "[1, 2147483647]"),
    ("--late-switch-step", "-3", "an integer >= 0"),
    ("--precision", "fp3", "invalid choice"),
    ("--mesh", "gpu=2", "AXIS=N"),
])
def test_bad_flag_values_name_flag_value_and_fix(flag, value, fix):
  assert_one_line_error([f"{flag}={value}"], f"argument {flag}: ",
                        repr(value), fix)


@pytest.mark.parametrize("argv, fragments", [
    (["--batch-size", "6", "--grad-accum", "4"],
     ["batch_size=6", "grad_accum=4"]),
    (["--steps", "10", "--late-switch-step", "20"],
     ["late_switch_step=20", "[0, 10]"]),
    (["--precision", "bf16", "--no-sr"], ["--no-sr", "bf16", "nvfp4"]),
    (["--tp-partial-sums", "bf16"], ["tp_partial_sums", "'bf16'", "'output'"]),
    (["--amax", "shard"], ["amax", "'shard'", "'local'"]),
    (["--wgrad-schedule", "late"], ["wgrad_schedule", "'late'", "'xla'"]),
    (["--wgrad-sums", "bf16"], ["wgrad_sums", "'bf16'", "'bfloat16'"]),
    (["--compare", "bf16,bf16"], ["--compare", "'bf16,bf16'", "e.g."]),
    (["--coordinator", "h:1234"], ["--coordinator h:1234", "--distributed"]),
    (["--process-id", "1"], ["--process-id 1", "without --distributed"]),
    (["--distributed"], ["--distributed", "--coordinator HOST:PORT",
                         "--num-processes"]),
])
def test_bad_flag_combinations_name_the_values(argv, fragments, tmp_path):
  # Small settings first: were the combination accepted, the run is short.
  small = FAST[2:] + ["--out", str(tmp_path)]
  assert_one_line_error(small + argv, *fragments)


# --- Data files and output paths -------------------------------------------


def _text(path, text):
  path.write_text(text)
  return path


def _bytes(path, content):
  path.write_bytes(content)
  return path


def _dir(path, files):
  path.mkdir()
  for name, content in files.items():
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_bytes(content)
  return path


# A .bin token file whose ids reach 299: a vocabulary of 300.
VOCAB_300 = (np.arange(4000, dtype="<u2") % 300).tobytes()

DATA_CASES = {
    # name: (make(tmp_path) -> path, fragments of the message)
    "missing": (lambda t: t / "missing.txt", ["no such file"]),
    "empty text": (lambda t: _text(t / "e.txt", ""), ["holds no text"]),
    "NUL bytes only": (lambda t: _bytes(t / "n.txt", b"\0" * 64),
                       ["holds no text"]),
    "odd-sized .bin": (lambda t: _bytes(t / "o.bin", b"abc"),
                       ["3 bytes", "uint16", "write_bin"]),
    "empty .bin": (lambda t: _bytes(t / "z.bin", b""),
                   ["0 bytes", "write_bin"]),
    "one-token .bin": (lambda t: _bytes(t / "1.bin", b"\1\0"),
                       ["0 train / 1 val tokens", "smaller --seq-len"]),
    "empty directory": (lambda t: _dir(t / "d", {}), ["has no files"]),
    "hidden files only": (lambda t: _dir(t / "h", {".git/x": b"text"}),
                          ["has no files"]),
    "no text in a directory": (
        lambda t: _dir(t / "nt", {"a.txt": b"", "b.txt": b"\0\0"}),
        ["2 files hold no text"]),
    "shorter than a sequence": (lambda t: _text(t / "s.txt", "tiny"),
                                ["--seq-len 16", "smaller --seq-len"]),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_names_the_file_and_the_fix(case, tmp_path):
  make, fragments = DATA_CASES[case]
  path = make(tmp_path)
  assert_one_line_error(FAST + ["--data", str(path), "--out",
                                str(tmp_path / "runs")],
                        str(path), *fragments)


def test_bad_paths_name_the_path(tmp_path):
  afile = _text(tmp_path / "afile", "x")
  assert_one_line_error(["--data="], "--data ''", "empty path")
  assert_one_line_error(["--out="], "--out ''", "--out .")
  assert_one_line_error(["--out", str(afile)], str(afile),
                        "not a directory")
  assert_one_line_error(["--out", str(afile / "sub")], str(afile),
                        "choose another --out")


def test_a_vocabulary_the_model_cannot_embed_names_both_sizes(tmp_path):
  corpus = data.load_corpus(_bytes(tmp_path / "v.bin", VOCAB_300))
  assert corpus.vocab_size == 300
  cfg = TrainConfig(precision="bf16", steps=1, batch_size=2, seq_len=16)
  with pytest.raises(ValueError, match=r"token id 299 is outside the model's "
                     r"vocabulary of 256 ids .* vocab_size > 299"):
    Trainer(cfg, corpus, preset("tiny", vocab_size=256))


# --- Resume ----------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A finished run's output directory and its flags."""
  tmp = tmp_path_factory.mktemp("resume")
  corpus = _text(tmp / "corpus.txt", (ROOT / "README.md").read_text())
  # Three steps: the bf16 run of test_cli's --compare test, whose programs
  # the session's compilation cache then holds.
  argv = FAST + ["--steps", "3", "--data", str(corpus), "--out",
                 str(tmp / "runs")]
  status, _, err = run_cli(argv)
  assert status == 0, err
  return tmp, argv


def test_resume_without_a_checkpoint_names_the_directory(finished_run,
                                                         tmp_path):
  _, argv = finished_run
  out = ["--out", str(tmp_path / "none")]
  assert_one_line_error(argv + out + ["--resume"], "--resume: no checkpoint",
                        str(tmp_path / "none" / "tiny-bf16"),
                        "run without --resume")
  # A checkpoint directory without a complete step (a run killed in its
  # first save: see test_crash_safety).
  (tmp_path / "none" / "tiny-bf16" / "checkpoints").mkdir(parents=True)
  assert_one_line_error(argv + out + ["--resume"],
                        "--resume: no complete checkpoint",
                        "run without --resume")


@pytest.mark.parametrize("change, fragment", [
    (["--lr", "0.001"], "train.lr: 0.003 -> 0.001"),
    # Other parameter shapes: the configuration is compared before the state
    # is read, so this is the same one line, not orbax's shape error.
    (["--mlp", "relu2"], "model.mlp: 'swiglu' -> 'relu2'"),
    (["--seed", "7"], "train.seed: 0 -> 7"),
])
def test_resume_with_other_flags_names_what_changed(finished_run, change,
                                                    fragment):
  _, argv = finished_run
  assert_one_line_error(argv + change + ["--resume"], fragment,
                        "use the same flags or a new --out")


def test_resume_on_data_of_another_vocabulary_says_which_data(finished_run):
  tmp, argv = finished_run
  tokens = _bytes(tmp / "v.bin", VOCAB_300)
  assert_one_line_error(argv + ["--data", str(tokens), "--resume"],
                        "model.vocab_size: 256 -> 300",
                        "the --data the run started with")
