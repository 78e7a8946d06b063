"""`python -m train.study`: the set, the commands, resumability, the table."""

import pytest

from train import study


def test_list_and_dry_run(tmp_path, capsys):
  assert study.main(["--preset", "tiny", "--steps", "10", "--out",
                     str(tmp_path), "--dry-run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  labels = [l.split()[0] for l in lines]
  # BF16, the full recipe and no-SR (its gap needs the noise floor) on
  # three seeds; each other ablation on one.
  assert labels[:9] == ["bf16-s0", "bf16-s1", "bf16-s2", "nvfp4-s0",
                        "nvfp4-s1", "nvfp4-s2", "nvfp4-no-sr-s0",
                        "nvfp4-no-sr-s1", "nvfp4-no-sr-s2"]
  for name in ("nvfp4-no-sr-s0", "nvfp4-no-rht-s0", "nvfp4-no-2d-s0",
               "nvfp4-all-quantized-s0", "nvfp4-4over6-s0", "mxfp4-s0",
               "nvfp4-switch-forward-s0", "nvfp4-switch-all-s0"):
    assert name in labels
  switch = next(l for l in lines if l.startswith("nvfp4-switch-forward"))
  assert "--late-switch-step 8 --late-switch-mode forward" in switch
  assert "--ckpt-every" not in switch  # The trainer's default unless given.


def test_common_flags_reach_every_run(tmp_path, capsys):
  assert study.main(["--preset", "tiny", "--steps", "10", "--out",
                     str(tmp_path), "--eval-every", "5", "--ckpt-every", "5",
                     "--mesh", "data=4", "--dry-run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 16
  assert all("--eval-every 5" in l and "--ckpt-every 5" in l
             and "--mesh data=4" in l for l in lines)


@pytest.mark.slow  # Trains a run of the study in a subprocess.
def test_runs_skips_finished_and_writes_results(tmp_path, capsys):
  argv = ["--preset", "tiny", "--steps", "3", "--batch-size", "4",
          "--seq-len", "32", "--eval-every", "3", "--out", str(tmp_path),
          "--only", "nvfp4-switch-forward-s0"]
  assert study.main(argv) == 0
  text = (tmp_path / "results.md").read_text()
  assert "| nvfp4-switch-forward-s0 |" in text and "--late-switch-step 2" in text
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
  capsys.readouterr()
  assert study.main(argv) == 0  # Nothing left to run.
  assert "finished earlier; skipped" in capsys.readouterr().out


def test_step_time_from_batched_records():
  """The trainer writes its train records in batches that share one time
  stamp; the step time is taken between batches (not 0 ms, as a
  record-to-record difference gave), and the first batch's compile time is
  left out."""
  recs = []
  for batch, t in enumerate((30.0, 30.5, 31.0, 31.6)):  # 5 steps per batch
    recs += [{"kind": "train", "step": 5 * batch + i + 1, "time": t}
             for i in range(5)]
  assert abs(study.step_seconds(recs) - 0.1) < 1e-9  # median of .1, .1, .12
  assert study.step_seconds(recs[:5]) != study.step_seconds(recs[:5])  # NaN


def test_stop_after_starts_no_further_run(tmp_path, capsys, monkeypatch):
  """With the time used up, the study starts nothing, says what is left and
  exits 0, so a time-limited job ends cleanly and a rerun goes on."""
  started = []
  monkeypatch.setattr(study.subprocess, "run",
                      lambda cmd, **_: started.append(cmd))
  assert study.main(["--preset", "tiny", "--steps", "3", "--out",
                     str(tmp_path), "--stop-after", "0"]) == 0
  assert not started
  out = capsys.readouterr().out
  assert "--stop-after 0 s reached; 16 run(s) left (bf16-s0," in out


def test_results_cover_earlier_runs_in_out(tmp_path, monkeypatch):
  """A study split into `--only` calls (one run a device session) reports
  every run found in `--out`: the BF16 run of an earlier call is in the
  table and the NVFP4 run gets its gap to it."""
  import json  # pylint: disable=g-import-not-at-top

  def metrics(label, precision, val):
    d = tmp_path / label / f"tiny-{precision}"
    d.mkdir(parents=True)
    recs = [{"kind": "train", "step": s, "loss": 1.0, "tokens": 128 * s,
             "time": float(s)} for s in (1, 2, 3)]
    recs.append({"kind": "eval", "step": 3, "val_loss": val})
    (d / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in recs))

  metrics("bf16-s0", "bf16", 2.0)  # The earlier call's run.
  monkeypatch.setattr(
      study.subprocess, "run",
      lambda cmd, **_: (metrics("nvfp4-s0", "nvfp4", 2.05),
                        study.subprocess.CompletedProcess(cmd, 0))[1])
  assert study.main(["--preset", "tiny", "--steps", "3", "--seeds", "0",
                     "--out", str(tmp_path), "--only", "nvfp4-s0"]) == 0
  text = (tmp_path / "results.md").read_text()
  assert "| bf16-s0 | 2.0000 | +0.00% ± 0.00% |" in text
  assert "| nvfp4-s0 | 2.0500 | +2.50% ± 0.00% |" in text
  assert "nvfp4-no-sr-s0" not in text  # Runs with no records stay out.
