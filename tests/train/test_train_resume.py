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
  # The weight gradients' schedule under FSDP changes no number: a run
  # resumes with the other one.
  again = Trainer(cfg.replace(wgrad_schedule="xla"), corpus, MODEL).run(
      tmp_path / "run", resume=True, progress=False)
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



def test_checkpoint_of_the_concatenated_layout_is_converted(tmp_path):
  """A checkpoint whose fused `qkv` and `[gate, up]` kernels are laid out
  "concatenated" (as every checkpoint written before `fused_layout`
  existed: its saved config lacks the field) resumes under the default
  "interleaved" layout with those kernels' columns permuted in the
  parameters, FP32 master weights and Adam moments alike, and nothing
  else changed; resumed with `fused_layout="concatenated"` it is left as
  it is. `train.export.restore_run` reads such a run in its own layout.
  (Without the conversion the resumed state would be the saved one, which
  the first assertion refuses.)"""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  from models import convert_fused_layout  # pylint: disable=g-import-not-at-top
  from train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  from train.export import restore_run  # pylint: disable=g-import-not-at-top
  from train.step import TrainState  # pylint: disable=g-import-not-at-top
  corpus = small_corpus()
  model = MODEL.replace(num_layers=1)
  old = model.replace(fused_layout="concatenated")
  cfg = config(precision="bf16", steps=1, ckpt_every=1, eval_every=1,
               eval_batches=1, warmup_steps=0, diagnostics=False)
  run = tmp_path / "run"
  # A trained-looking state of the old layout (Adam's moments are zeros at
  # init): every float leaf random, step 1 (the run's end).
  state = Trainer(cfg, corpus, old).init_state()
  leaves, tree = jax.tree.flatten(state)
  rng = np.random.default_rng(0)
  leaves = [rng.standard_normal(np.shape(x)).astype(x.dtype)
            if np.issubdtype(x.dtype, np.floating) else np.asarray(x)
            for x in leaves]
  state = TrainState(*jax.tree.unflatten(tree, leaves))._replace(
      step=np.int32(1))
  saved = {"train": cfg.to_dict(), "model": dataclasses.asdict(old)}
  del saved["model"]["fused_layout"]  # As an older version wrote it.
  run.mkdir()
  (run / "config.json").write_text(json.dumps(saved))
  with Checkpointer(run / "checkpoints") as ckpt:
    ckpt.save(1, state, saved)
  now = {"train": cfg.to_dict(), "model": dataclasses.asdict(model)}
  with Checkpointer(run / "checkpoints") as ckpt:
    got = Trainer(cfg, corpus, model)._start(ckpt, now, resume=True)  # pylint: disable=protected-access
  want = convert_fused_layout(state, model, "concatenated", "interleaved")
  jax.tree.map(np.testing.assert_array_equal, tuple(got), tuple(want))
  moved = [p for p, (a, b) in zip(
      jax.tree_util.tree_flatten_with_path(want)[0],
      zip(jax.tree.leaves(want), jax.tree.leaves(state)))
           if not np.array_equal(a, b)]
  # qkv and up: the bf16 parameter, its FP32 master, Adam's mu and nu.
  assert len(moved) == 8, [jax.tree_util.keystr(p[0]) for p in moved]
  back = convert_fused_layout(want, model, "interleaved", "concatenated")
  jax.tree.map(np.testing.assert_array_equal, tuple(back), tuple(state))
  # The public path: a finished run resumes as a no-op reporting its
  # (converted) FP32 master parameters.
  again = Trainer(cfg, corpus, model).run(run, resume=True, progress=False)
  jax.tree.map(np.testing.assert_array_equal, again.params,
               nvfp4_jax.master_params(want.opt_state))
  # Resumed in the layout it was written in: as it is.
  now["model"]["fused_layout"] = "concatenated"
  with Checkpointer(run / "checkpoints") as ckpt:
    same = Trainer(cfg, corpus, old)._start(ckpt, now, resume=True)  # pylint: disable=protected-access
  jax.tree.map(np.testing.assert_array_equal, tuple(same), tuple(state))
  # The exporter reads the old run (config.json as it was) in its layout.
  (run / "config.json").write_text(json.dumps(saved))
  _, mcfg, _, params, _ = restore_run(run)
  assert mcfg.fused_layout == "concatenated"
  jax.tree.map(np.testing.assert_array_equal, params,
               nvfp4_jax.master_params(state.opt_state))
