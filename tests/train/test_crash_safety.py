"""`python -m train` killed with SIGKILL (mid-save too) and resumed.

Each kill is a real `kill -9` of a real training process, at moments chosen
by watching its outputs: while orbax is writing a checkpoint (its temporary
step directory exists, the final one does not) in a fresh run and in resumed
ones, the first and the last save included, and between saves. Every
`--resume` must continue from the last complete checkpoint, and the metrics
at the end must equal an uninterrupted run's: the same train losses and
evaluations, bit for bit, and no duplicated lines.

The processes share a persistent JAX compilation cache (the first run
compiles, the later ones mostly load), which keeps the test under a minute on
two CPU cores.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import jax
import orbax.checkpoint as ocp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 8

# Six training processes: the slow tier. (The fast tier resumes a killed run
# in-process: tests/test_train_resume.py.)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="bit-identical resumption is promised on CPU; GPU reductions are "
    "not deterministic across compilations")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax-cache")
  return dict(os.environ, JAX_PLATFORMS="cpu",
              JAX_COMPILATION_CACHE_DIR=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "corpus.txt"
  path.write_text((ROOT / "README.md").read_text() * 3)
  return path


def argv(corpus, out, *extra):
  # The smallest run that still saves 4 checkpoints and evaluates twice.
  return [sys.executable, "-m", "train", "--precision", "bf16",
          "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32",
          "--ckpt-every", "2", "--eval-every", "4", "--no-diagnostics",
          "--no-progress", "--data", str(corpus), "--out", str(out), *extra]


def finish(args, env) -> subprocess.CompletedProcess:
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert "Traceback" not in proc.stderr, proc.stderr
  return proc


def kill_when(args, env, condition, *, timeout=300.0) -> None:
  """Starts `args` and SIGKILLs it as soon as `condition()` holds."""
  with tempfile.TemporaryFile("w+") as log:  # A pipe could fill and block.
    proc = subprocess.Popen(args, cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + timeout
    try:
      while not condition():
        if proc.poll() is not None:
          log.seek(0)
          pytest.fail(f"the run ended (status {proc.returncode}) before the "
                      f"moment to kill it:\n{log.read()}")
        if time.monotonic() > deadline:
          pytest.fail("the moment to kill the run never came")
        time.sleep(0.002)
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.kill()
      proc.wait()


PARTIAL = " (partial)"


def saving(ckpt_dir: pathlib.Path, step: int):
  """True while orbax writes `step`: its temporary directory exists.

  The run may remove `ckpt_dir` while it is being listed (a run started
  without `--resume` clears the partial saves of the one before): that
  is "not yet", not an error.
  """
  prefix = f"{step}{ocp.step.TMP_DIR_SUFFIX}"

  def condition():
    try:
      return any(p.name.startswith(prefix) for p in ckpt_dir.iterdir())
    except FileNotFoundError:
      return False
  return condition


def logged_anew(run: pathlib.Path, step: int):
  """True once a resumed run has rewritten metrics.jsonl (it truncates it to
  its checkpoint, as a new file) and logged `step` there."""
  path = run / "metrics.jsonl"
  before = path.stat().st_ino

  def condition():
    try:
      if path.stat().st_ino == before:
        return False
      lines = path.read_text().splitlines()
    except FileNotFoundError:
      return False
    return f'"kind": "train", "step": {step},' in "\n".join(lines)
  return condition


def steps_on_disk(ckpt_dir: pathlib.Path) -> list[str]:
  """Step directories: "4" complete, "6 (partial)" being written."""
  names = []
  for p in ckpt_dir.iterdir():
    step, tmp, _ = p.name.partition(ocp.step.TMP_DIR_SUFFIX)
    names.append(step + PARTIAL if tmp else p.name)
  return sorted(names, key=lambda n: int(n.split()[0]))


def records(run: pathlib.Path) -> list[dict]:
  """metrics.jsonl without the wall-clock field; every line must parse."""
  lines = (run / "metrics.jsonl").read_text().splitlines()
  out = [json.loads(line) for line in lines]
  for r in out:
    r.pop("time", None)
  return out


def test_sigkill_at_any_save_then_resume_equals_an_uninterrupted_run(
    tmp_path, env, corpus):
  # The uninterrupted run (first: it fills the compilation cache).
  proc = finish(argv(corpus, tmp_path / "ref"), env)
  assert (proc.returncode, proc.stderr) == (0, "")
  expected = records(tmp_path / "ref" / "tiny-bf16")
  assert [r["step"] for r in expected if r["kind"] == "train"] == list(
      range(1, STEPS + 1))
  assert [r["step"] for r in expected if r["kind"] == "eval"] == [4, STEPS]

  out = tmp_path / "crashed"
  run = out / "tiny-bf16"
  ckpt = run / "checkpoints"

  # Killed inside its first save: no complete checkpoint. `--resume` says so
  # in one line (no orbax thread cut off at exit, no traceback) and removes
  # the partial save.
  kill_when(argv(corpus, out), env, saving(ckpt, 2))
  assert steps_on_disk(ckpt) == ["2" + PARTIAL]
  proc = finish(argv(corpus, out, "--resume"), env)
  assert proc.returncode == 2
  assert proc.stderr.splitlines() == [
      f"nvfp4-train: error: --resume: no complete checkpoint in "
      f"{ckpt.resolve()}; run without --resume to start this run."]
  assert steps_on_disk(ckpt) == []

  # Started again as the message says, killed while saving step 6: step 4 is
  # the last complete checkpoint; the metrics already hold steps 5-6.
  kill_when(argv(corpus, out), env, saving(ckpt, 6))
  assert steps_on_disk(ckpt) == ["2", "4", "6" + PARTIAL]
  assert records(run)[-1]["step"] == 6
  # Resumed from 4 (the partial save is discarded), killed between saves,
  # once step 5 is logged.
  kill_when(argv(corpus, out, "--resume"), env, logged_anew(run, 5))
  assert "4" in steps_on_disk(ckpt) and str(STEPS) not in steps_on_disk(ckpt)
  # Resumed again, killed inside the last save, after the final evaluation
  # was logged.
  kill_when(argv(corpus, out, "--resume"), env, saving(ckpt, STEPS))
  assert steps_on_disk(ckpt) == ["4", "6", f"{STEPS}{PARTIAL}"]
  last = records(run)[-1]
  assert (last["kind"], last["step"]) == ("eval", STEPS)
  # Resumed from 6 to the end.
  proc = finish(argv(corpus, out, "--resume"), env)
  assert (proc.returncode, proc.stderr) == (0, "")
  assert steps_on_disk(ckpt) == ["6", str(STEPS)]

  # Bit for bit: losses, gradient norms, learning rates, evaluations; no
  # line twice.
  assert records(run) == expected
