"""Preemption (issue 58): SIGTERM and SIGINT stop a run after the step in
flight with a checkpoint of it, and `--resume` continues bit-identically.

End to end through `python -m train` in subprocesses, signalled from
outside at moments chosen by watching what the run writes (its metrics, or
a line `tests/support/signal_driver.py` prints while it holds a save in flight):

- SIGTERM while an asynchronous save is being written: training went on
  meanwhile; the run waits for that write, saves the step it reached (its
  metrics up to it, nothing after), prints one line naming the step, its
  checkpoint and `--resume`, and exits 143; both checkpoints are whole.
- SIGINT (slow tier; the fast tier stops the Python API with it): status
  130, with its checkpoint; a SIGTERM during that save is ignored. A second SIGINT during the save ends the process at once: the
  step being written is left as orbax's temporary directory and the
  previous checkpoint survives.
- The resumed run's metrics then equal an uninterrupted run's, bit for bit
  (CPU), with no line twice.
- Two processes (`--distributed`, slow tier): a SIGTERM sent to one of them,
  later a SIGINT to the other; both stop at the same step each time and the
  resumed runs equal an uninterrupted two-process run bit for bit.

The fast tier also stops `Trainer.run(handle_signals=True)` in-process, with
SIGTERM and with SIGINT.
Without the handlers (`handle_signals=False`, or before this feature) a
SIGTERM kills the process with no checkpoint and no line: every test here
fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "signal_driver.py"
STEPS = 20
EVERY = 4  # Checkpoints at 4, 8, ...; two kept.

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="bit-identical resumption is promised on CPU; GPU reductions are "
    "not deterministic across compilations")


def _env(devices: int = 1) -> dict[str, str]:
  # The session's compilation cache (conftest) reaches the processes through
  # the environment: the first run compiles, the others load.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
          os.pathsep) if p]))
  if devices > 1:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_"
                        f"platform_device_count={devices}").strip()
  return env


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "corpus.txt"
  path.write_text((ROOT / "README.md").read_text() * 3)
  return path


def flags(corpus, out, *extra) -> list[str]:
  return ["--precision", "bf16", "--steps", str(STEPS), "--batch-size", "2",
          "--seq-len", "32", "--ckpt-every", str(EVERY), "--eval-every", "8",
          "--no-diagnostics", "--no-progress", "--data", str(corpus),
          "--out", str(out), *extra]


class Run:
  """A `python -m train` (or driver) process with its output in files."""

  def __init__(self, args, env, tmp: pathlib.Path, name: str):
    self.out = open(tmp / f"{name}.out", "w+")  # A pipe could fill, block.
    self.err = open(tmp / f"{name}.err", "w+")
    self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.out,
                                 stderr=self.err, text=True)

  def wait_for(self, condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if self.proc.poll() is not None:
        pytest.fail(f"the run ended (status {self.proc.returncode}) before "
                    f"{what}:\n{self.stderr()[-3000:]}")
      if time.monotonic() > deadline:
        pytest.fail(f"{what} never came:\n{self.stderr()[-3000:]}")
      time.sleep(0.002)

  def printed(self, text: str):
    return lambda: text in pathlib.Path(self.out.name).read_text()

  def signal(self, sig) -> None:
    self.proc.send_signal(sig)

  def finish(self, timeout: float = 300) -> int:
    try:
      return self.proc.wait(timeout=timeout)
    finally:
      self.proc.kill()
      self.proc.wait()
      self.out.close()
      self.err.close()

  def stderr(self) -> str:
    return pathlib.Path(self.err.name).read_text()


def cli(corpus, out, tmp, name, *extra, hooks=(), env=None) -> Run:
  args = ([sys.executable, str(DRIVER), *hooks, "--"] if hooks
          else [sys.executable, "-m", "train"])
  return Run(args + flags(corpus, out, *extra), env or _env(), tmp, name)


def records(run: pathlib.Path) -> list[dict]:
  """metrics.jsonl without the wall-clock field; every line must parse."""
  out = [json.loads(line) for line in
         (run / "metrics.jsonl").read_text().splitlines()]
  for r in out:
    r.pop("time", None)
  return out


def logged(run: pathlib.Path, step: int):
  path = run / "metrics.jsonl"

  def condition():
    try:
      return f'"kind": "train", "step": {step},' in path.read_text()
    except FileNotFoundError:
      return False
  return condition


def on_disk(ckpt: pathlib.Path) -> list[str]:
  """Step directories: "4" complete, "6 (partial)" being written."""
  names = []
  for p in ckpt.iterdir():
    step, tmp, _ = p.name.partition(ocp.step.TMP_DIR_SUFFIX)
    names.append(step + " (partial)" if tmp else p.name)
  return sorted(names, key=lambda n: int(n.split()[0]))


STOPPED = re.compile(
    r"nvfp4-train: (SIGTERM|SIGINT): stopped after step (\d+) of (\d+), "
    r"checkpoint saved in (\S+); continue with the same flags and --resume")


def stopped_line(run: Run, sig: str) -> tuple[int, pathlib.Path]:
  """The one line a stopped run prints: (its step, its checkpoint)."""
  lines = [l for l in run.stderr().splitlines() if STOPPED.fullmatch(l)]
  assert len(lines) == 1, run.stderr()
  m = STOPPED.fullmatch(lines[0])
  assert (m.group(1), int(m.group(3))) == (sig, STEPS), lines[0]
  assert "Traceback" not in run.stderr(), run.stderr()
  return int(m.group(2)), pathlib.Path(m.group(4))


def whole(ckpt: pathlib.Path, step: int) -> None:
  """Step `step` is a complete checkpoint whose files match its record."""
  from train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(ckpt, read_only=True) as c:
    assert step in c.all_steps(), on_disk(ckpt)
    assert c.damage(step) is None, c.damage(step)
    assert (c.path(step) / "nvfp4_files.json").is_file()


@pytest.fixture(scope="module")
def expected(corpus, tmp_path_factory):
  """The uninterrupted run's metrics (it also fills the compilation cache)."""
  tmp = tmp_path_factory.mktemp("reference")
  run = cli(corpus, tmp / "runs", tmp, "ref")
  assert run.finish() == 0, run.stderr()
  recs = records(tmp / "runs" / "tiny-bf16")
  assert [r["step"] for r in recs if r["kind"] == "train"] == list(
      range(1, STEPS + 1))
  return recs


def _sigterm_mid_save(corpus, out, tmp_path) -> int:
  """SIGTERM from outside while the asynchronous save of step 4 is being
  written (held open by the driver): training goes on meanwhile (a
  synchronous save would hold the loop at step 4 and stop it there), the
  run waits for that write, then saves the step it reached and its
  metrics, nothing after it. Returns that step."""
  run_dir = out / "tiny-bf16"
  ckpt = run_dir / "checkpoints"
  run = cli(corpus, out, tmp_path, "a", hooks=("--hold", f"{EVERY}:3"))
  run.wait_for(run.printed(f"holding the save of step {EVERY}"),
               f"the save of step {EVERY}")
  run.signal(signal.SIGTERM)
  assert run.finish() == 143, run.stderr()
  s, path = stopped_line(run, "SIGTERM")
  # The signal came within the 3 s hold, so the loop stopped at the latest
  # at step 8, whose periodic save waits for step 4's.
  assert EVERY < s <= 2 * EVERY, s
  assert path == (ckpt / str(s)).resolve()
  assert on_disk(ckpt) == [str(EVERY), str(s)]
  whole(ckpt, EVERY)
  whole(ckpt, s)
  assert records(run_dir)[-1]["step"] == s
  return s


def _resume_to_the_end(corpus, out, tmp_path, expected) -> None:
  """Resumed from the newest complete checkpoint (a partial save is
  discarded) to the end: the metrics equal the uninterrupted run's, bit
  for bit, no line twice."""
  run_dir = out / "tiny-bf16"
  run = cli(corpus, out, tmp_path, "d", "--resume")
  assert run.finish() == 0, run.stderr()
  assert records(run_dir) == expected
  assert on_disk(run_dir / "checkpoints")[-1] == str(STEPS)


def test_sigterm_mid_save_then_resume_bit_identically(tmp_path, corpus,
                                                       expected):
  out = tmp_path / "runs"
  _sigterm_mid_save(corpus, out, tmp_path)
  _resume_to_the_end(corpus, out, tmp_path, expected)


@pytest.mark.slow  # Two training processes more than the test above.
def test_signals_mid_run_and_mid_save_then_resume_bit_identically(
    tmp_path, corpus, expected):
  """The SIGTERM above, then SIGINT with a repeated SIGTERM, then a second
  SIGINT during a save, then the resumption to the end."""
  out = tmp_path / "runs"
  ckpt = out / "tiny-bf16" / "checkpoints"
  s = _sigterm_mid_save(corpus, out, tmp_path)

  # Resumed; SIGINT after the next step, and a SIGTERM while its save is
  # held: ignored (schedulers repeat SIGTERM), the save completes, status
  # 130.
  run = cli(corpus, out, tmp_path, "b", "--resume",
            hooks=("--signal-at", f"{s + 1}:SIGINT", "--hold",
                   f"{s + 1}:2"))
  run.wait_for(run.printed(f"holding the save of step {s + 1}"),
               f"the save of step {s + 1}")
  run.signal(signal.SIGTERM)
  assert run.finish() == 130, run.stderr()
  assert "SIGTERM again: already stopping" in run.stderr(), run.stderr()
  assert stopped_line(run, "SIGINT")[0] == s + 1
  whole(ckpt, s + 1)

  # Resumed; SIGINT after two more steps and a second one while that
  # step's save is held: the process ends at once (not after the 60 s
  # hold), leaving the save as orbax's temporary directory; the previous
  # checkpoint is whole.
  run = cli(corpus, out, tmp_path, "c", "--resume",
            hooks=("--signal-at", f"{s + 3}:SIGINT", "--hold",
                   f"{s + 3}:60"))
  run.wait_for(run.printed(f"holding the save of step {s + 3}"),
               f"the save of step {s + 3}")
  t0 = time.monotonic()
  run.signal(signal.SIGINT)
  assert run.finish(timeout=30) == 130, run.stderr()
  assert time.monotonic() - t0 < 30
  want = ("second SIGINT: stopped at once, without finishing the checkpoint; "
          f"the newest complete checkpoint is {(ckpt / str(s + 1)).resolve()}")
  assert want in run.stderr(), run.stderr()
  assert not STOPPED.search(run.stderr())
  assert on_disk(ckpt)[-1] == f"{s + 3} (partial)", on_disk(ckpt)
  whole(ckpt, s + 1)

  # The partial save is discarded; the run resumes from s + 1.
  _resume_to_the_end(corpus, out, tmp_path, expected)


def test_trainer_run_handle_signals(tmp_path):
  """The Python API: `Trainer.run(handle_signals=True)` returns at the
  signalled step with `stopped` set and its checkpoint saved (no plots),
  puts the process's handlers back, and resumes to the uninterrupted
  run's parameters."""
  from tiny_training import MODEL, config, small_corpus  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  cfg = config(precision="bf16", steps=4, ckpt_every=4, eval_every=4,
               warmup_steps=1, eval_batches=1, diagnostics=False)
  model = MODEL.replace(num_layers=1)
  trainer = Trainer(cfg, small_corpus(), model)
  full = trainer.run(tmp_path / "full", progress=False)
  assert full.stopped is None and full.step == 4

  before = signal.getsignal(signal.SIGTERM)
  result = trainer.run(
      tmp_path / "run", progress=False, handle_signals=True,
      on_step=lambda done: done == 2 and os.kill(os.getpid(),
                                                 signal.SIGTERM))
  assert signal.getsignal(signal.SIGTERM) is before
  assert (result.stopped, result.step) == ("SIGTERM", 2)
  assert result.checkpoint == (tmp_path / "run" / "checkpoints" /
                               "2").resolve()
  assert result.loss_plot is None
  whole(tmp_path / "run" / "checkpoints", 2)
  resumed = trainer.run(tmp_path / "run", resume=True, progress=False)
  assert resumed.stopped is None
  jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)

  # SIGINT (Ctrl-C) stops it the same way, instead of KeyboardInterrupt.
  before = signal.getsignal(signal.SIGINT)
  result = trainer.run(
      tmp_path / "interrupted", progress=False, handle_signals=True,
      on_step=lambda done: done == 3 and os.kill(os.getpid(),
                                                 signal.SIGINT))
  assert signal.getsignal(signal.SIGINT) is before
  assert (result.stopped, result.step) == ("SIGINT", 3)
  whole(tmp_path / "interrupted" / "checkpoints", 3)


def _free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


@pytest.mark.slow  # Eight training processes (four pairs): ~110 s of CPU.
def test_two_processes_stop_at_the_same_step_and_resume_bit_identically(
    tmp_path, corpus):
  """`--distributed` as two processes of one CPU device each (mesh
  data=2), as the two-process test of tests/test_mesh.py. A SIGTERM to
  process 1 alone reaches process 0 through JAX's preemption service, and a
  later SIGINT to process 0 alone reaches process 1: each time both save the
  same step (process 0 reports SIGINT, 130; the other SIGTERM, 143). The
  resumed runs' metrics equal an uninterrupted two-process run's bit for
  bit (the same program, the same collectives in the same order)."""
  def pair(out, name, *extra):
    port = _free_port()
    return [cli(corpus, out, tmp_path, f"{name}{i}", "--mesh", "data=2",
                "--distributed", "--coordinator", f"localhost:{port}",
                "--num-processes", "2", "--process-id", str(i), *extra)
            for i in range(2)]

  ref = pair(tmp_path / "ref", "ref")
  for r in ref:
    assert r.finish() == 0, r.stderr()
  expected = records(tmp_path / "ref" / "tiny-bf16")
  assert len([r for r in expected if r["kind"] == "train"]) == STEPS

  out = tmp_path / "runs"
  run_dir = out / "tiny-bf16"
  steps = []
  for name, target, sig, resume in (("term", 1, signal.SIGTERM, ()),
                                    ("int", 0, signal.SIGINT,
                                     ("--resume",))):
    runs = pair(out, name, *resume)
    after = steps[-1] + EVERY if steps else EVERY
    runs[0].wait_for(logged(run_dir, after), f"step {after} logged")
    runs[target].signal(sig)
    codes = [r.finish() for r in runs]
    names = ["SIGTERM", "SIGTERM"]
    names[target] = sig.name
    assert codes == [128 + signal.Signals[n] for n in names], (
        codes, runs[0].stderr()[-2000:], runs[1].stderr()[-2000:])
    stops = [stopped_line(r, n)[0] for r, n in zip(runs, names)]
    assert stops[0] == stops[1] and after <= stops[0] < STEPS, stops
    whole(run_dir / "checkpoints", stops[0])
    steps.append(stops[0])
  runs = pair(out, "end", "--resume")
  for r in runs:
    assert r.finish() == 0, r.stderr()
  assert records(run_dir) == expected


@pytest.mark.slow  # Two training processes: ~30 s of CPU.
def test_two_processes_without_jax_preemption_service(tmp_path, corpus):
  """With JAX's preemption service off (`JAX_ENABLE_PREEMPTION_SERVICE=
  false`), the processes agree through an all-gather of their flags at
  every step: a SIGTERM to process 1 alone still stops both at one step,
  both saving it."""
  env = dict(_env(), JAX_ENABLE_PREEMPTION_SERVICE="false")
  port = _free_port()
  out = tmp_path / "runs"
  runs = [cli(corpus, out, tmp_path, f"p{i}", "--mesh", "data=2",
              "--distributed", "--coordinator", f"localhost:{port}",
              "--num-processes", "2", "--process-id", str(i), env=env)
          for i in range(2)]
  runs[0].wait_for(logged(out / "tiny-bf16", EVERY), f"step {EVERY} logged")
  runs[1].signal(signal.SIGTERM)
  codes = [r.finish() for r in runs]
  assert codes == [143, 143], (codes, runs[0].stderr()[-2000:],
                               runs[1].stderr()[-2000:])
  stops = [stopped_line(r, "SIGTERM")[0] for r in runs]
  assert stops[0] == stops[1] and EVERY <= stops[0] < STEPS, stops
  whole(out / "tiny-bf16" / "checkpoints", stops[0])
