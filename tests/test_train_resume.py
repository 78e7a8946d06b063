"""Checkpoints: a run killed and resumed continues bit-identically on CPU."""

import json

import jax
import numpy as np
import pytest

from tiny_training import MODEL, config, small_corpus
from train.checkpoint import config_changes
from train.loop import Trainer
from train.metrics import read_metrics, select


class Killed(Exception):
  pass


def _kill_at(step):
  def on_step(done):
    if done == step:
      raise Killed(done)
  return on_step


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="bit-identical resumption is promised on CPU; GPU reductions are "
    "not deterministic across compilations")
def test_killed_and_resumed_run_is_bit_identical(tmp_path):
  corpus = small_corpus()
  # NVFP4 with stochastic rounding: the SR keys must continue correctly too.
  cfg = config(steps=10, ckpt_every=3, eval_every=5, diagnostics=False)
  trainer = Trainer(cfg, corpus, MODEL)
  full = trainer.run(tmp_path / "full", progress=False)

  run = tmp_path / "killed"
  with pytest.raises(Killed):
    trainer.run(run, progress=False, log_every=1, on_step=_kill_at(8))
  # Killed after step 8: metrics up to 8 were written, the last checkpoint is 6.
  assert select(read_metrics(run / "metrics.jsonl"), "train")[-1]["step"] == 8
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["3", "6"]

  # A new trainer, as in a new process: all it shares is the directory.
  resumed = Trainer(cfg, corpus, MODEL).run(run, resume=True, progress=False)
  train = select(resumed.records, "train")
  assert [r["step"] for r in train] == list(range(1, 11))  # No duplicates.
  losses = [r["loss"] for r in train]
  assert losses == [r["loss"] for r in select(full.records, "train")]
  assert [e["val_loss"] for e in select(resumed.records, "eval")] == [
      e["val_loss"] for e in select(full.records, "eval")]
  jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)


def test_resume_refuses_other_settings_and_missing_checkpoints(tmp_path):
  corpus = small_corpus()
  cfg = config(precision="bf16", steps=2, ckpt_every=2, eval_every=2,
               warmup_steps=1, diagnostics=False)
  Trainer(cfg, corpus, MODEL).run(tmp_path / "run", progress=False)
  with pytest.raises(ValueError, match=r"train\.lr: 0\.003 -> 0\.001"):
    Trainer(cfg.replace(lr=1e-3), corpus, MODEL).run(
        tmp_path / "run", resume=True, progress=False)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    Trainer(cfg, corpus, MODEL).run(tmp_path / "empty", resume=True,
                                    progress=False)
  # Resuming a finished run is a no-op that reports the same result.
  again = Trainer(cfg, corpus, MODEL).run(tmp_path / "run", resume=True,
                                          progress=False)
  assert [r["step"] for r in select(again.records, "train")] == [1, 2]
  # A checkpoint of an older version, which lacked a field added since
  # (`residuals`), resumes where the field keeps its default.
  meta = tmp_path / "run" / "checkpoints" / "2" / "config" / "metadata"
  saved = json.loads(meta.read_text())
  del saved["train"]["residuals"]
  meta.write_text(json.dumps(saved))
  again = Trainer(cfg, corpus, MODEL).run(tmp_path / "run", resume=True,
                                          progress=False)
  assert [r["step"] for r in select(again.records, "train")] == [1, 2]


def test_config_changes_of_fields_an_older_checkpoint_lacks():
  saved = {"train": {"lr": 0.003}, "model": {"d_model": 64}}
  now = {"train": {"lr": 0.003, "residuals": "codes"},
         "model": {"d_model": 64, "remat": "none"}}
  defaults = {"train": {"lr": 0.003, "residuals": "codes"},
              "model": {"remat": "none"}}
  assert config_changes(saved, now, defaults) == []
  # Without defaults, or with a value other than the default, it changed.
  assert config_changes(saved, now) == [
      "model.remat: None -> 'none'", "train.residuals: None -> 'codes'"]
  now["train"]["residuals"] = "values"
  assert config_changes(saved, now, defaults) == [
      "train.residuals: None -> 'values'"]
