"""Issue 42: no command deletes checkpoints unless told to, and a damaged
newest checkpoint costs only itself.

End to end through the CLIs (`python -m train`, `python -m train.export`) on
copies of one finished tiny run with checkpoints at steps 2 and 3: a rerun
without `--resume` refuses in one line naming `--resume` and `--overwrite`
and changes nothing; `--overwrite` starts again; each kind of damaged newest
checkpoint (truncated arrays, a garbled config, a missing `state/`) is
skipped by `--resume`, named with why, kept as `<step>.damaged`, and the run
continues from the older one to the same losses; export names it too; and
the older good checkpoint survives every failed attempt, byte for byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import shutil
import time

import jax
import pytest

from train import cli
from train import export as export_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
# test_cli_errors' finished run: the session's compilation cache holds its
# programs. Three steps checkpoint every step; two are kept (2 and 3).
ARGV = ["--precision", "bf16", "--steps", "3", "--batch-size", "2",
        "--seq-len", "16", "--no-diagnostics", "--no-progress"]


def run_cli(main, argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = main(argv)
  return status, out.getvalue(), err.getvalue()


def one_line_error(main, argv, *fragments, prog="nvfp4-train") -> str:
  status, _, err = run_cli(main, argv)
  assert status == 2, err
  assert "Traceback" not in err, err
  lines = [l for l in err.splitlines() if not l.startswith("WARNING:absl")]
  assert len(lines) == 1, err
  assert lines[0].startswith(f"{prog}: error: "), err
  for fragment in fragments:
    assert fragment in lines[0], (fragment, lines[0])
  return lines[0]


def digest(path: pathlib.Path) -> dict[str, str]:
  """Every file under `path` (relative name -> sha256 of its bytes)."""
  return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(path.rglob("*")) if p.is_file()}


def records(run: pathlib.Path) -> list[dict]:
  out = [json.loads(l) for l in (run / "metrics.jsonl").read_text()
         .splitlines()]
  for r in out:
    r.pop("time", None)
  return out


def _train(tmp: pathlib.Path) -> None:
  corpus = tmp / "corpus.txt"
  corpus.write_text((ROOT / "README.md").read_text())
  status, _, err = run_cli(cli.main, ARGV + ["--data", str(corpus), "--out",
                                             str(tmp / "runs")])
  assert status == 0, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished run: `(its --out directory, the corpus flag)`.

  Trained once per session: under pytest-xdist the first worker trains it
  in the session's shared temporary directory and the others wait for it.
  """
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    tmp = tmp_path_factory.mktemp("finished")
    _train(tmp)
  else:
    shared = tmp_path_factory.getbasetemp().parent / "run_safety"
    try:
      os.mkdir(str(shared) + ".lock")
    except FileExistsError:
      deadline = time.monotonic() + 600
      while not shared.is_dir():
        assert time.monotonic() < deadline, "the shared run never came"
        time.sleep(0.2)
    else:
      tmp = pathlib.Path(str(shared) + ".tmp")
      tmp.mkdir()
      _train(tmp)
      tmp.rename(shared)  # The others see it complete or not at all.
    tmp = shared
  ckpt = tmp / "runs" / "tiny-bf16" / "checkpoints"
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3"]
  return tmp / "runs", ["--data", str(tmp / "corpus.txt")]


@pytest.fixture
def run(finished, tmp_path):
  """A copy of the finished run: `(argv for it, its run directory)`."""
  out, data = finished
  shutil.copytree(out, tmp_path / "runs")
  return ARGV + data + ["--out", str(tmp_path / "runs")], (
      tmp_path / "runs" / "tiny-bf16")


def truncate_arrays(step_dir: pathlib.Path) -> str:
  files = [p for p in (step_dir / "state").rglob("*")
           if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
  return "its file state/"


def garble_config(step_dir: pathlib.Path) -> str:
  (step_dir / "config" / "metadata").write_text('{"train": {"lr": 0.0')
  return "its config/metadata is not valid JSON"


def remove_state(step_dir: pathlib.Path) -> str:
  shutil.rmtree(step_dir / "state")
  return "it has no state/ directory"


DAMAGE = {"truncated arrays": truncate_arrays,
          "garbled config JSON": garble_config,
          "missing state/": remove_state}


def test_a_rerun_without_resume_refuses_and_changes_nothing(run):
  argv, run_dir = run
  before = digest(run_dir)
  one_line_error(cli.main, argv, str(run_dir), "steps 2, 3", "--resume",
                 "--overwrite")
  one_line_error(cli.main, argv + ["--resume", "--overwrite"],
                 "--resume and --overwrite contradict")
  # A failed --resume (other flags) changes nothing either.
  one_line_error(cli.main, argv + ["--resume", "--lr", "0.001"],
                 "train.lr: 0.003 -> 0.001", "use the same flags")
  assert digest(run_dir) == before


def test_overwrite_starts_the_run_again(run, finished):
  argv, run_dir = run
  (run_dir / "checkpoints" / "3.damaged").mkdir()  # Kept ones go too.
  status, _, err = run_cli(cli.main, argv + ["--overwrite"])
  assert status == 0, err
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
      "2", "3"]
  assert records(run_dir) == records(finished[0] / "tiny-bf16")


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="bit-identical resumption is promised on CPU")
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint(run, finished, damage):
  argv, run_dir = run
  ckpt = run_dir / "checkpoints"
  good = digest(ckpt / "2")
  why = DAMAGE[damage](ckpt / "3")
  status, _, err = run_cli(cli.main, argv + ["--resume"])
  assert status == 0, err
  assert "Traceback" not in err
  assert err.splitlines() == [
      f"warning: --resume: skipped the damaged checkpoint {ckpt / '3.damaged'}"
      f" ({why}" + err.split(why, 1)[1].splitlines()[0],
      "warning: --resume: resuming from step 2, the newest checkpoint that "
      "restores"]
  assert "; kept as 3.damaged)" in err
  # Kept (renamed, not deleted); step 3 saved anew; step 2 untouched; the
  # run continued to the same losses as the uninterrupted one.
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3", "3.damaged"]
  assert digest(ckpt / "2") == good
  assert records(run_dir) == records(finished[0] / "tiny-bf16")
  # A rerun without flags still refuses: the damaged one counts.
  one_line_error(cli.main, argv, "steps 2, 3, 3.damaged", "--overwrite")


def test_every_checkpoint_damaged_refuses_and_keeps_them(run):
  argv, run_dir = run
  ckpt = run_dir / "checkpoints"
  truncate_arrays(ckpt / "3")
  garble_config(ckpt / "2")
  before = {name: digest(ckpt / name) for name in ("2", "3")}
  one_line_error(cli.main, argv + ["--resume"], "no checkpoint in",
                 f"{ckpt / '3.damaged'} (its file state/", "truncated",
                 f"{ckpt / '2.damaged'} (its config/metadata is not valid "
                 f"JSON", "--overwrite")
  assert {name: digest(ckpt / f"{name}.damaged") for name in ("2", "3")} == (
      before)
  # Asked again: they are named, kept, and the fix is the same.
  one_line_error(cli.main, argv + ["--resume"],
                 "holds only damaged checkpoints (2.damaged, 3.damaged)",
                 "--overwrite")
  assert {name: digest(ckpt / f"{name}.damaged") for name in ("2", "3")} == (
      before)


def test_export_names_a_damaged_checkpoint_and_uses_the_older_one(run,
                                                                  tmp_path):
  _, run_dir = run
  ckpt = run_dir / "checkpoints"
  truncate_arrays(ckpt / "3")
  before = digest(ckpt)
  out = tmp_path / "tiny.safetensors"
  status, stdout, err = run_cli(export_cli.main, [str(run_dir), str(out)])
  assert status == 0, err
  warnings = [l for l in err.splitlines() if not l.startswith("WARNING:absl")]
  assert len(warnings) == 1 and warnings[0].startswith(
      f"python -m train.export: warning: skipped the damaged checkpoint "
      f"{ckpt / '3'} (its file state/"), err
  assert "(run bf16, step 2)" in stdout and out.is_file()
  assert digest(ckpt) == before  # Read only: nothing renamed or removed.
  # Every checkpoint damaged, or the run's config.json: one line, exit 2.
  remove_state(ckpt / "2")
  one_line_error(export_cli.main, [str(run_dir), str(out)],
                 f"{ckpt / '3'} (its file state/",
                 f"{ckpt / '2'} (it has no state/ directory", "--resume",
                 prog="python -m train.export")
  (run_dir / "config.json").write_text("{garbled")
  one_line_error(export_cli.main, [str(run_dir), str(out)],
                 str(run_dir / "config.json"), "not valid JSON", "--resume",
                 prog="python -m train.export")
