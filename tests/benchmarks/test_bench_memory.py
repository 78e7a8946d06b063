"""`benchmarks.bench_memory --search model`: the largest GPT of a ladder on a
device mesh (the bookkeeping; the slow test runs the CPU smoke mode)."""

import io
import json
import math
import os
import subprocess
import sys
import types

import pytest

from benchmarks import bench_memory as bm

GIB = 2**30
LADDER = bm.parse_ladder(bm.LADDER)
PARAMS = [bm.approx_params(r) for r in LADDER]


def test_ladder_shapes():
  """The presets keep their own heads and d_ff; the GPT-3-like rungs get
  heads of 128 and d_ff = 8/3 d_model to a multiple of 256; the parameter
  count from the shape is the model's own (models.param_count)."""
  from models import GPTConfig  # pylint: disable=g-import-not-at-top
  from models import param_count  # pylint: disable=g-import-not-at-top
  assert bm.shape_fields(768, 18) == {"d_model": 768, "num_layers": 18,
                                      "num_heads": 12, "d_ff": 2048}
  assert bm.shape_fields(2048, 24) == {"d_model": 2048, "num_layers": 24,
                                       "num_heads": 16, "d_ff": 5376}
  for rung in ("1024x28", "1536x2"):
    cfg = GPTConfig(**bm.shape_fields(*bm.parse_rung(rung)))
    assert param_count(cfg) == bm.approx_params(rung)
  # The default ladder: 25.6M (small) to 38.6B.
  assert round(PARAMS[0] / 1e5) == 256 and round(PARAMS[-1] / 1e8) == 386


def _truth(peak, limit):
  return max((i for i in range(len(LADDER)) if peak(i) <= limit), default=-1)


@pytest.mark.parametrize("name,peak", [
    # Bytes per device on 4 shards: the state plus activations.
    ("the first guess's", lambda i: bm.prior_bytes_per_param(4) * PARAMS[i]),
    ("state", lambda i: 4.0 * PARAMS[i] + 2 * GIB),
    ("state, more than the guess", lambda i: 6.0 * PARAMS[i] + 6 * GIB),
    ("convex", lambda i: 3.0 * PARAMS[i] + 1e-10 * PARAMS[i] ** 2),
    ("a jump at the 8th rung", lambda i: 4.0 * PARAMS[i] + (
        30 * GIB if i >= 7 else 0)),
    ("nothing fits", lambda i: 100 * GIB + PARAMS[i]),
    ("everything fits", lambda i: 1e-3 * PARAMS[i]),
])
@pytest.mark.parametrize("limit_gib", [19.8, 59.4])
def test_next_rung_finds_the_largest_fitting_rung(name, peak, limit_gib):
  """The compile search ends on a closed bracket (the rung that fits, the
  next over, or a ladder's end), each compile strictly inside the bracket,
  in at most 4 compiles of the 15 rungs; in rounds of two side by side
  (`plan_compiles`), at most 3 rounds."""
  limit = limit_gib * GIB
  truth = _truth(peak, limit)
  peaks = {}
  while (i := bm.next_rung(peaks, LADDER, limit, shards=4)) is not None:
    lo, hi = bm.bracket(peaks, LADDER, limit)
    assert lo < i < hi and LADDER[i] not in peaks, (name, i, peaks)
    peaks[LADDER[i]] = peak(i)
  assert bm.bracket(peaks, LADDER, limit) == (truth, truth + 1), (name,
                                                                   peaks)
  assert len(peaks) <= 4, (name, list(peaks))
  if name == "the first guess's":  # Right at once: it and the next, 2.
    assert len(peaks) == 2, list(peaks)
  peaks, rounds = {}, 0
  while todo := bm.plan_compiles(peaks, LADDER, limit, shards=4):
    lo, hi = bm.bracket(peaks, LADDER, limit)
    assert all(lo < i < hi and LADDER[i] not in peaks for i in todo)
    peaks.update({LADDER[i]: peak(i) for i in todo})
    rounds += 1
  assert bm.bracket(peaks, LADDER, limit) == (truth, truth + 1)
  assert rounds <= 3, (name, list(peaks))
  if name == "the first guess's":
    assert rounds == 1


def test_plan_compiles_pairs_the_guess_with_its_neighbors():
  limit = 60 * GIB
  # Before any peak, the guess and both its neighbors.
  (i, j, k) = bm.plan_compiles({}, LADDER, limit, shards=4)
  assert i + 1 == j == k - 1 == bm.next_rung({}, LADDER, limit, shards=4)
  # After one, the guess and the rung above it.
  peaks = {LADDER[j]: 2 * limit}
  (i, j) = bm.plan_compiles(peaks, LADDER, limit, shards=4)
  assert i + 1 == j and i == bm.next_rung(peaks, LADDER, limit, shards=4)
  # The guess at the bracket's top: paired with the rung below.
  peaks = {LADDER[2]: 1.0, LADDER[5]: 2 * limit}
  assert bm.plan_compiles(peaks, LADDER, limit) == [3, 4]
  assert bm.plan_compiles(peaks, LADDER, limit, pair=False) == [4]
  assert bm.plan_compiles({LADDER[2]: 1.0, LADDER[3]: 2 * limit}, LADDER,
                          limit) == []


def test_next_rung_counts_a_compile_out_of_memory_as_over():
  peaks = {LADDER[5]: None}
  assert bm.bracket(peaks, LADDER, 60 * GIB) == (-1, 5)
  assert bm.next_rung(peaks, LADDER, 60 * GIB) < 5


def test_next_model_run_steps_down_after_out_of_memory():
  """None while the search is open; then the search's answer; after a run
  out of memory the rung below; done on success, on an error, at the
  ladder's foot or after three runs."""
  ladder = bm.parse_ladder("128x1,128x2,256x2,256x4")
  peaks = {ladder[2]: 10.0, ladder[3]: 20.0}
  nr = lambda runs, peaks=peaks: bm.next_model_run(peaks, ladder, 15.0, [
      {"rung": ladder[i], "ok": ok, **extra} for i, ok, extra in runs])
  assert nr([], {ladder[3]: 20.0}) is None  # Still searching.
  assert nr([]) == 2
  assert nr([(2, False, {})]) == 1
  assert nr([(2, False, {}), (1, False, {})]) == 0
  assert nr([(2, False, {}), (1, False, {}), (0, False, {})]) is None
  assert nr([(2, False, {}), (1, True, {})]) is None
  assert nr([(2, False, {"error": 1})]) is None
  assert bm.next_model_run({ladder[0]: 20.0}, ladder, 15.0, []) is None


class _FakeChildren:
  """Children of `model_main` without processes: compiles take 10 fake
  seconds (peak 10 bytes a parameter), runs 5; every run must find no other
  run in flight."""

  def __init__(self, clock, compile_s=lambda params: 10.0):
    self.clock, self.procs, self.compiled = clock, [], []
    self.compile_s = compile_s

  def __call__(self, cmd, **_):
    fake = self
    i = cmd.index("--model-child")
    lim = (float(cmd[cmd.index("--limit-gib") + 1]) * GIB
           if "--limit-gib" in cmd else 60 * GIB)
    dur = 0.0
    if "--limit-probe" in cmd:
      out = {"limit": lim, "device": "fake"}
    else:
      rung = cmd[cmd.index("--try-rung") + 1]
      params = bm.approx_params(rung)
      assert json.loads(cmd[i + 1])["mesh"] == "fsdp=8"
      if "--compile-only" in cmd:
        self.compiled.append(rung)
        dur = self.compile_s(params)
        out = {"rung": rung, "peak": 10.0 * params, "params": params,
               "s": dur, "note": "", "limit": lim}
      else:
        assert not [q for q in self.procs if q.run and q.poll() is None]
        out, dur = {"rung": rung, "ok": True, "peak": 10.0 * params,
                    "params": params, "s": 5.0, "step_s": 0.1,
                    "device": "fake", "jax": "x"}, 5.0

    class Proc:
      returncode = 0
      run = "--try-rung" in cmd and "--compile-only" not in cmd
      finish = fake.clock.now + dur
      stdout = io.StringIO(json.dumps(out))

      def poll(self):
        return self.returncode if fake.clock.now >= self.finish else None

      def communicate(self):
        return self.stdout.read(), None

      def kill(self):
        self.returncode, self.finish = -9, -1.0

      def wait(self):
        return self.returncode

    proc = Proc()
    self.procs.append(proc)
    return proc


def test_model_search_runs_and_resumes_from_its_state(tmp_path, monkeypatch,
                                                     capsys):
  """The parent's rounds with faked children and clock: a call stopped by
  its budget keeps every finished compile in its state; the next call goes
  on from there (no finished rung compiled again) and ends where one
  uninterrupted call ends; runs go one at a time."""
  clock = _fake_clock(monkeypatch)
  children = _FakeChildren(clock)
  monkeypatch.setattr(subprocess, "Popen", children)
  args = ["--search", "model", "--mesh", "fsdp=8", "--ladder",
          bm.SMOKE["ladder"], "--limit-gib", "0.03", "--seq", "32",
          "--batch", "1"]
  whole = bm.main(args + ["--state-dir", str(tmp_path / "whole")])
  n = len(children.compiled)
  # 10 bytes a parameter under 0.03 GiB: 256x2 (1.84M) fits, 256x4 (3.54M)
  # does not, for both precisions.
  assert [r["largest_ran"] for r in whole] == ["256x2", "256x2"]
  assert [r["next_up"] for r in whole] == ["256x4 (3.541M)"] * 2
  assert n > 2 * 2  # More than one round of two compiles each.
  children.compiled.clear()
  children.procs.clear()
  clock.now = 0.0
  part = bm.main(args + ["--state-dir", str(tmp_path / "s"), "--budget-s",
                         "15", "--grace-s", "0"])
  assert [r["largest_ran"] for r in part] == [
      "not run (search unfinished)"] * 2
  assert "goes on from here" in capsys.readouterr().out
  first = list(children.compiled)
  files = sorted((tmp_path / "s").glob("model_*.json"))
  kept = [r for f in files for r in json.loads(f.read_text())["rungs"]]
  assert 0 < len(kept) < len(first)  # The second round was stopped.
  children.compiled.clear()
  children.procs.clear()
  clock.now = 0.0
  again = bm.main(args + ["--state-dir", str(tmp_path / "s")])
  assert again == whole
  assert "goes on from here" not in capsys.readouterr().out
  assert not set(children.compiled) & set(kept)
  assert len(kept) + len(children.compiled) == n


def _fake_clock(monkeypatch):
  clock = types.SimpleNamespace(now=0.0)

  def sleep(dt):
    clock.now += dt

  monkeypatch.setattr(bm, "time", types.SimpleNamespace(
      time=lambda: clock.now, sleep=sleep, strftime=lambda _: "t",
      perf_counter=lambda: clock.now))
  return clock


def test_model_search_stops_compiles_the_bracket_no_longer_needs(
    tmp_path, monkeypatch, capsys):
  """The first round compiles the guess and both neighbors; once the
  smaller two close the bracket, the larger (slower) compile is stopped
  rather than waited for."""
  children = _FakeChildren(_fake_clock(monkeypatch),
                           compile_s=lambda params: params / 1e5)
  monkeypatch.setattr(subprocess, "Popen", children)
  # 10 bytes a parameter under 10 MB: 128x2 (0.47M) fits, 256x2 (1.84M)
  # does not; the first guess (3.75 bytes a parameter on fsdp=8) is 256x2.
  (row,) = bm.main(["--search", "model", "--mesh", "fsdp=8", "--ladder",
                    bm.SMOKE["ladder"], "--limit-gib", str(1e7 / GIB),
                    "--seq", "32", "--batch", "1", "--precisions", "bf16",
                    "--state-dir", str(tmp_path)])
  assert children.compiled == ["128x2", "256x2", "256x4"]
  assert "compile of 256x4 stopped: not needed" in capsys.readouterr().err
  assert row["largest_ran"] == "128x2" and row["compiles"] == 2


def test_model_rows():
  """The row names the largest rung that ran, its peak, the next rung up and
  why it does not fit (its compiled peak, or out of memory when run)."""
  ladder = bm.parse_ladder("128x1,128x2,256x2,256x4")
  rung = lambda r, p: {"peak": p * GIB, "params": bm.approx_params(r),
                       "s": 2.0, "note": ""}
  run = lambda r, ok, p: {"rung": r, "ok": ok, "peak": p * GIB,
                          "params": bm.approx_params(r), "s": 5.0,
                          "step_s": 0.5, "device": "d", "jax": "j"}
  c = bm.MeshConfig("nvfp4", "quantized", 32, 1, "fsdp=8", ladder)
  rungs = {"128x2": rung("128x2", 1.0), "256x2": rung("256x2", 2.0),
           "256x4": rung("256x4", 3.0)}
  st = {"limit": 2.5 * GIB, "rungs": rungs,
        "runs": [run("256x2", True, 2.0)]}
  (row,) = bm.model_rows([c], {c.label: st})
  assert row["largest_ran"] == "256x2" and row["peak_gib"] == "2"
  assert row["next_up"].startswith("256x4 (3.54") and (
      row["next_peak_gib"] == "3")
  assert row["compiles"] == 3 and row["compile_s"] == 6
  st["runs"] = [run("256x2", False, 2.0), run("128x2", True, 1.0)]
  (row,) = bm.model_rows([c], {c.label: st})
  assert row["largest_ran"] == "128x2"
  assert row["next_peak_gib"] == "2, out of memory when run"
  st["runs"] = [{"rung": "256x2", "ok": False, "error": 1}]
  (row,) = bm.model_rows([c], {c.label: st})
  assert row["largest_ran"] == "run failed (exit 1)"
  st["runs"] = [run("256x2", True, 2.0)]
  rungs["256x4"] = {"peak": None, "params": 1, "s": 0.0, "error": 1}
  (row,) = bm.model_rows([c], {c.label: st})
  assert row["next_peak_gib"] == "compile failed (exit 1), not a memory answer"
  (row,) = bm.model_rows([c], {c.label: {}})
  assert row["largest_ran"] == "not run (search unfinished)"


def test_model_children_environment():
  """Compile-only children leave the allocator unfilled (they run side by
  side); runs preallocate as users do; the smoke mode has 8 CPU devices."""
  env = bm.model_env({"XLA_FLAGS": "--xla_foo"}, "/s", compile_only=True,
                     smoke=True)
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert env["JAX_PLATFORMS"] == "cpu"
  assert env["XLA_FLAGS"] == (
      "--xla_foo --xla_force_host_platform_device_count=8")
  env = bm.model_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "/s",
                     compile_only=False)
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  assert "JAX_PLATFORMS" not in env


@pytest.mark.parametrize("mesh", ["fsdp", "fsdp=0", "fsdp=x", "tensor=4",
                                  "fsdp=2,fsdp=2"])
def test_bad_mesh_is_refused(mesh):
  with pytest.raises(SystemExit, match=r"--mesh .*(fsdp=4|twice)"):
    bm.parse_mesh(mesh)


def test_bad_arguments_are_refused(capsys, tmp_path):
  with pytest.raises(SystemExit):
    bm.main(["--search", "models"])
  assert "invalid choice: 'models'" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="needs --mesh"):
    bm.main(["--search", "model"])
  with pytest.raises(SystemExit, match="belong to --search model"):
    bm.main(["--mesh", "fsdp=4"])
  with pytest.raises(SystemExit, match="increasing parameter count"):
    bm.main(["--search", "model", "--mesh", "fsdp=4", "--ladder",
             "1024x28,768x18", "--state-dir", str(tmp_path)])
  with pytest.raises(SystemExit, match="'1000x4' is not DxL"):
    bm.parse_ladder("1000x4")
  with pytest.raises(SystemExit, match="'fsdp=four' is not AXIS=SIZE"):
    bm.main(["--search", "model", "--mesh", "fsdp=four"])


def _smoke(state_dir, *extra):
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_memory", "--smoke",
       "--state-dir", str(state_dir), *extra],
      capture_output=True, text=True, check=True,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(
          os.path.abspath(__file__)))))
  return out.stdout, out.stderr


@pytest.mark.slow
def test_smoke_finds_and_runs_the_largest_rung_then_resumes(tmp_path):
  """8 CPU devices, fsdp=8, the tiny ladder under a limit inside it: each
  precision's search ends on a rung whose compiled peak is within the limit
  with the next rung's over, runs it for two steps, and a second call
  resumes from the state (runs only, no compile), a third does nothing."""
  _, err = _smoke(tmp_path, "--no-run")
  assert "compiled in" in err and "two steps ran" not in err
  out, err = _smoke(tmp_path)
  assert "compiled in" not in err and err.count("two steps ran") == 2, err
  ladder = bm.parse_ladder(bm.SMOKE["ladder"])
  limit = bm.SMOKE["limit_gib"] * GIB
  for prec in ("bf16", "nvfp4"):
    c = bm.MeshConfig(prec, "quantized", bm.SMOKE["seq"], bm.SMOKE["batch"],
                      bm.SMOKE["mesh"], ladder)
    with open(tmp_path / ("model_" + bm._slug(c.label) + ".json")) as f:
      st = json.load(f)
    assert st["limit"] == limit
    (run,) = st["runs"]
    i = ladder.index(run["rung"])
    assert run["ok"] and run["peak"] <= limit
    # Uniform random bytes: ln 256 at initialization, about that after one
    # update (the run is a real step, not a failed one read as done).
    assert abs(run["loss"] - math.log(256)) < 0.5
    assert st["rungs"][run["rung"]]["peak"] <= limit
    assert st["rungs"][ladder[i + 1]]["peak"] > limit  # Inside the ladder.
    assert f"| {prec} | quantized | fsdp=8 | 1x32 | {run['rung']} |" in out
  out2, err2 = _smoke(tmp_path)
  assert "compiled in" not in err2 and "ran" not in err2
  assert out2.splitlines()[1:] == out.splitlines()[1:]
