"""train/: the jitted step, NaN skipping, schedules, diagnostics, outputs."""

import io
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from models import preset
from train import data
from train.config import TrainConfig
from train.diagnostics import tensor_stats
from train import metrics
from train.loop import Trainer
from train.metrics import read_metrics, select
from train.optim import wsd_schedule

# A small GPT whose paper preset still quantizes one block (block_2 of 4).
MODEL = preset("tiny", d_model=64, num_layers=4, num_heads=2, d_ff=128)


def small_corpus() -> data.Corpus:
  root = data.stdlib_root()
  text = b"".join((root / f).read_bytes() for f in (
      "os.py", "json/decoder.py", "textwrap.py", "functools.py"))
  tokens = np.frombuffer(text, np.uint8)
  n = len(tokens) * 9 // 10
  return data.Corpus(train=tokens[:n], val=tokens[n:], vocab_size=256,
                     source="test")


def config(**kw) -> TrainConfig:
  fields = dict(preset="tiny", precision="nvfp4", steps=24, batch_size=4,
                seq_len=32, lr=3e-3, warmup_steps=3, eval_every=8,
                ckpt_every=8, eval_batches=2)
  fields.update(kw)
  return TrainConfig(**fields)


def named_gemms(trainer: Trainer) -> dict[str, int]:
  state = trainer.init_state()
  batch = trainer.batcher.batch(0).reshape(
      trainer.cfg.grad_accum, trainer.cfg.micro_batch, -1)
  closed = jax.make_jaxpr(trainer._train_step)(state, batch)
  text = str(closed)
  names = re.findall(r"name=(nvfp4_(?:fprop|dgrad|wgrad))\b", text)
  return {n: names.count(n) for n in set(names)} | {
      "switch": _precision_switches(closed.jaxpr)}


def _precision_switches(jaxpr) -> int:
  """Conds with one branch running an NVFP4 Fprop and the other none."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      has = ["name=nvfp4_fprop" in str(b) for b in eqn.params["branches"]]
      count += len(has) == 2 and has[0] != has[1]
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          count += _precision_switches(inner)
  return count


def test_tiny_training_loss_decreases_and_writes_outputs(tmp_path):
  trainer = Trainer(config(), small_corpus(), MODEL)
  result = trainer.run(tmp_path, progress=False)
  train = select(result.records, "train")
  losses = [r["loss"] for r in train]
  assert [r["step"] for r in train] == list(range(1, 25))
  assert np.mean(losses[:3]) - np.mean(losses[-3:]) > 1.0, losses
  evals = select(result.records, "eval")
  assert [e["step"] for e in evals] == [8, 16, 24]
  assert evals[-1]["val_loss"] < evals[0]["val_loss"]
  assert result.final_val_loss == evals[-1]["val_loss"]
  assert result.skipped == 0 and all(r["finite"] for r in train)
  # Warmup-stable-decay learning rate, logged per step.
  lrs = [r["lr"] for r in train]
  assert lrs[0] == pytest.approx(1e-3) and lrs[2] == pytest.approx(3e-3)
  assert lrs[-1] < 3e-3 / 4
  # Diagnostics: every NVFP4Dense, flagged quantized as the paper rules say.
  diag = select(result.records, "diag")[-1]["layers"]
  assert len(diag) == 16
  for path, stats in diag.items():
    assert stats["quantized"] == path.startswith("block_2/"), path
    assert 0 < stats["x_flushed"] < 0.6 and 0 < stats["w_rel_err"] < 0.3
  # Files for people and for resuming.
  for name in ("loss.png", "diagnostics.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert json.loads((tmp_path / "config.json").read_text())["train"][
      "precision"] == "nvfp4"
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
      "16", "24"]
  assert read_metrics(tmp_path / "metrics.jsonl") == result.records


def test_train_step_quantizes_per_rules_and_switches_without_recompiling():
  corpus = small_corpus()
  gemms = named_gemms(Trainer(config(), corpus, MODEL))
  # block_2's four projections, each with its three quantized GEMMs.
  assert gemms["nvfp4_fprop"] == gemms["nvfp4_dgrad"] == 4
  assert gemms["nvfp4_wgrad"] == 4
  assert not any(k.startswith("nvfp4") for k in named_gemms(
      Trainer(config(precision="bf16"), corpus, MODEL)))
  # The late switch is a lax.cond on the traced step in each quantized layer.
  switched = named_gemms(Trainer(config(late_switch_step=10), corpus, MODEL))
  assert gemms["switch"] == 0 and switched["switch"] >= 4


def test_late_switch_moves_quantized_layers_to_bf16_from_its_step(tmp_path):
  corpus = small_corpus()
  kw = dict(steps=6, eval_every=6, ckpt_every=6, diagnostics=False)
  plain = Trainer(config(**kw), corpus, MODEL).run(tmp_path / "a",
                                                   progress=False)
  trainer = Trainer(config(late_switch_step=4, **kw), corpus, MODEL)
  switch = trainer.run(tmp_path / "b", progress=False)
  loss = lambda r: [x["loss"] for x in select(r.records, "train")]
  # Steps 0-3 run NVFP4 in both runs; from step 4 on the switched one is BF16.
  assert loss(switch)[:4] == loss(plain)[:4]
  assert all(a != b for a, b in zip(loss(switch)[4:], loss(plain)[4:]))
  # The diagnostics flag layers by what their forward GEMM runs at that step.
  stats = {"block_2/mlp/up": {}, "block_0/mlp/up": {}}
  assert trainer._diag_record(stats, 3) == {
      "block_2/mlp/up": {"quantized": True},
      "block_0/mlp/up": {"quantized": False}}
  assert not trainer._diag_record(stats, 4)["block_2/mlp/up"]["quantized"]


def test_non_finite_step_is_skipped_counted_and_not_applied():
  trainer = Trainer(config(), small_corpus(), MODEL)
  state = trainer.init_state()
  batch = trainer.batcher.batch(0).reshape(1, 4, 33)
  poisoned = jax.tree.map(lambda x: x, state.params)
  poisoned["head"]["kernel"] = poisoned["head"]["kernel"].at[0, 0].set(jnp.nan)
  state = state._replace(params=poisoned)
  before = jax.device_get(state)
  state, metrics = trainer.train_step(state, batch)
  assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
  assert int(state.skipped) == 1 and int(state.step) == 1
  after = jax.device_get(state)
  # Parameters and optimizer state (master weights, Adam moments and count)
  # are exactly as before.
  jax.tree.map(np.testing.assert_array_equal, after.opt_state,
               before.opt_state)
  jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
  master = nv.master_params(after.opt_state)
  assert np.all(np.isfinite(master["head"]["kernel"]))
  # A finite step afterwards is applied.
  state = state._replace(params=jax.tree.map(
      jnp.asarray, nv.master_params(after.opt_state)))
  state, metrics = trainer.train_step(state, batch)
  assert bool(metrics["finite"]) and int(state.skipped) == 1
  assert not np.array_equal(nv.master_params(state.opt_state)["head"]["kernel"],
                            master["head"]["kernel"])


def test_gradient_accumulation_matches_one_big_batch():
  corpus = small_corpus()
  cfg = config(precision="bf16", batch_size=8)
  one = Trainer(cfg, corpus, MODEL)
  two = Trainer(cfg.replace(grad_accum=2), corpus, MODEL)
  batch = one.batcher.batch(0)
  s1, m1 = one.train_step(one.init_state(), batch.reshape(1, 8, -1))
  s2, m2 = two.train_step(two.init_state(), batch.reshape(2, 4, -1))
  assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
  assert float(m1["grad_norm"]) == pytest.approx(float(m2["grad_norm"]),
                                                 rel=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               s1.params, s2.params)


def test_wsd_schedule():
  s = wsd_schedule(1.0, total=100, warmup=10, decay_fraction=0.2)
  lr = np.array([float(s(i)) for i in range(100)])
  np.testing.assert_allclose(lr[:10], np.arange(1, 11) / 10)
  np.testing.assert_allclose(lr[10:80], 1.0)
  assert np.all(np.diff(lr[80:]) < 0) and lr[-1] == pytest.approx(1 / 20)


def test_tensor_stats_flushed_and_saturated():
  x = np.ones((16, 32), np.float32)
  x[0, :16] = 0.0
  x[0, 0] = 1000.0                   # Tensor amax: 1000, alone in its block.
  # Row 1, block 0: block amax 0.01 -> scale 0.01 * 2688 / 1000 / 6 = 0.00448,
  # subnormal in E4M3 (step 2^-9): rounds to 0.00390625, so 0.01 scales to
  # 6.88 (clipped to 6 but < 7: not saturated) and 0.0005 to 0.34 -> 0.5.
  x[1, :16] = 0.0005
  x[1, 0] = 0.01
  # Row 2, block 0: block amax 0.0065 -> 0.0029 rounds down to 2^-9:
  # 0.0065 scales to 8.9 > 7: saturated.
  x[2, :16] = 0.0065
  # Row 3, block 1: values below 1/4 of the block's FP4 step flush to zero.
  x[3, 16:] = 1.0
  x[3, 16:20] = 0.01
  s = jax.device_get(tensor_stats(jnp.asarray(x), block_2d=False))
  assert s["saturated"] == pytest.approx(1 / 32)
  assert s["flushed"] == pytest.approx(4 / np.count_nonzero(x))
  assert 0 < s["rel_err"] < 0.01
  w = jax.device_get(tensor_stats(jnp.asarray(x), block_2d=True))
  assert w["saturated"] == 0.0  # One tile holds 1000: no subnormal scales.


def test_progress_bar_shows_loss_tokens_per_second_and_eta(monkeypatch):
  clock = iter(range(0, 1000))
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: float(next(clock)))

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  log, tty = io.StringIO(), Terminal()
  for stream in (log, tty):
    bar = metrics.Progress(20, stream=stream, label="nvfp4 ")
    for step in range(1, 21):
      bar.update(step, 3.0 - 0.1 * step, 2048)  # One second per step.
    bar.close()
  lines = log.getvalue().splitlines()
  assert 10 <= len(lines) <= 12  # About every 10% when not a terminal.
  assert lines[5].startswith("nvfp4 [")
  assert "10/20 loss 2.0000 2.0k tok/s ETA 0:10" in lines[5]
  assert lines[-1].endswith("20/20 loss 1.0000 2.0k tok/s ETA 0:00")
  assert tty.getvalue().count("\r") == 20 and tty.getvalue().endswith("\n")
  quiet = io.StringIO()
  bar = metrics.Progress(20, stream=quiet, enabled=False)
  bar.update(1, 1.0, 10)
  bar.close()
  assert quiet.getvalue() == ""
