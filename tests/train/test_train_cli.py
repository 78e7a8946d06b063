"""The command line: `python -m train` / `nvfp4-train`."""

import importlib
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from train import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--compare", "bf16,fp3"], "--compare: unknown precision 'fp3'"),
    (["--compare", "nvfp4"], "--compare needs two or more"),
    (["--precision", "nvfp4", "--compare", "bf16,nvfp4"], "not allowed with"),
    (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    (["--steps", "ten"], "--steps: expected a positive integer"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--batch-size", "6", "--grad-accum", "4"], "not divisible by grad_accum"),
    (["--steps", "10", "--late-switch-step", "20"], "outside the run"),
    (["--data", "/no/such/corpus.txt"], "--data /no/such/corpus.txt: no such"),
])
def test_bad_flags_give_one_clear_line(argv, message, capsys):
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("nvfp4-train: error: ")
  assert message in lines[0]


def test_bad_out_and_resume_paths(tmp_path, capsys):
  afile = tmp_path / "file"
  afile.write_text("x")
  assert cli.main(["--out", str(afile)]) == 2
  assert "is not a directory" in capsys.readouterr().err
  assert cli.main(["--out", str(tmp_path / "new"), "--resume"]) == 2
  err = capsys.readouterr().err
  assert "--resume: no checkpoint in" in err and len(err.splitlines()) == 1
  empty = tmp_path / "empty"
  empty.mkdir()
  assert cli.main(["--data", str(empty)]) == 2
  assert "the directory has no files" in capsys.readouterr().err


def test_module_entry_point_exits_nonzero_with_one_line():
  proc = subprocess.run([sys.executable, "-m", "train", "--precision", "fp2"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stdout == ""
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith(
      "nvfp4-train: error: argument --precision: invalid choice: 'fp2'")


def test_console_script_points_at_main():
  scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "scripts"]
  module, func = scripts["nvfp4-train"].split(":")
  assert getattr(importlib.import_module(module), func) is cli.main


@pytest.mark.slow  # Two tiny trainings and their resume through the CLI
# (~45 s); the Trainer itself trains in the fast tier (test_train.py).
def test_compare_prints_table_and_one_plot_then_resumes(tmp_path, capsys):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text((ROOT / "README.md").read_text() * 3)
  out = tmp_path / "runs"
  argv = ["--compare", "bf16,nvfp4", "--steps", "3", "--batch-size", "2",
          "--seq-len", "16", "--data", str(corpus), "--out", str(out),
          "--no-progress", "--no-diagnostics"]
  assert cli.main(argv) == 0
  text = capsys.readouterr().out
  table = re.search(r"precision +train loss +val loss +val gap vs bf16.*?\n"
                    r"-+\n(bf16 .*)\n(nvfp4 .*)\n", text)
  assert table, text
  assert re.search(r"nvfp4 +\d+\.\d{4} +\d+\.\d{4} +[+-]\d+\.\d\d% +0",
                   table.group(2))
  plot = out / "tiny-bf16-vs-nvfp4.png"
  assert f"comparison plot: {plot}" in text
  assert plot.read_bytes()[:4] == b"\x89PNG"
  for p in ("bf16", "nvfp4"):
    assert (out / f"tiny-{p}" / "metrics.jsonl").exists()
    assert (out / f"tiny-{p}" / "loss.png").exists()
  # Resuming finished runs trains nothing more and reports the same table.
  assert cli.main(argv + ["--resume"]) == 0
  again = capsys.readouterr().out
  assert table.group(0) in again


def test_sequence_parallel_reaches_the_trainers_mesh_rules(monkeypatch):
  """`--sequence-parallel` and `--collective-matmul` reach `TrainConfig`
  and the trainer's `MeshRules` (off without the flags); the collective
  matmul alone is refused, naming both flags."""
  import jax  # pylint: disable=g-import-not-at-top
  from nvfp4_jax import sharding  # pylint: disable=g-import-not-at-top
  from tiny_training import small_corpus  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  # The mesh rules are what is checked: no step is traced or compiled.
  monkeypatch.setattr(Trainer, "_shard", lambda self, mr: None)
  mesh = sharding.make_mesh(jax.devices()[:1], data=1)
  parser = cli.build_parser()
  for flags, want in (([], (False, False)),
                      (["--sequence-parallel"], (True, False)),
                      (["--sequence-parallel", "--collective-matmul"],
                       (True, True))):
    args = parser.parse_args(["--compare", "bf16,nvfp4", "--batch-size", "2",
                              "--seq-len", "16", *flags])
    cfgs = cli.make_configs(args, ["bf16", "nvfp4"])
    assert [(c.sequence_parallel, c.collective_matmul) for c in cfgs] == [
        want, want]
    rules = Trainer(cfgs[1], small_corpus(), mesh=mesh).mesh_rules
    assert (rules.sequence_parallel, rules.collective_matmul) == want
  args = parser.parse_args(["--batch-size", "2", "--collective-matmul"])
  with pytest.raises(cli.UsageError, match="--sequence-parallel "
                     "--collective-matmul"):
    cli.make_configs(args, ["nvfp4"])
