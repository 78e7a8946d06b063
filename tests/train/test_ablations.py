"""Ablation and model switches of the trainer (--no-sr, --no-rht, --no-2d,
--four-over-six, --residuals, --all-quantized, --attention, --remat) reach
the traced step."""

import jax
import jax.numpy as jnp
import pytest

from models import preset
from train import build
from train import cli
from train.config import TrainConfig
from train.loop import Trainer
from train.report import gemm_report
from tiny_training import small_corpus

MODEL = preset("tiny", d_model=64, num_layers=4, num_heads=2, d_ff=128)


def _report(**kw):
  cfg = TrainConfig(preset="tiny", steps=4, batch_size=4, seq_len=32,
                    diagnostics=False, **kw)
  trainer = Trainer(cfg, small_corpus(), MODEL.replace(
      attention=cfg.attention, remat=cfg.remat))
  batch = jax.ShapeDtypeStruct((1, 4, 33), jnp.int32)
  return gemm_report(trainer.fns.train_step,
                     jax.eval_shape(trainer.fns.init_state), batch)


def _formats(report, gemm):
  return {g.precision for g in report.quantized if g.gemm == gemm}


@pytest.mark.parametrize("flags,fprop,dgrad,wgrad", [
    ({}, "nvfp4,nvfp4-16x16", "nvfp4-sr,nvfp4-16x16",
     "nvfp4-sr-rht16,nvfp4-rht16"),
    (dict(sr=False), "nvfp4,nvfp4-16x16", "nvfp4,nvfp4-16x16",
     "nvfp4-rht16,nvfp4-rht16"),
    (dict(rht=False), "nvfp4,nvfp4-16x16", "nvfp4-sr,nvfp4-16x16",
     "nvfp4-sr,nvfp4"),
    (dict(two_d=False), "nvfp4,nvfp4", "nvfp4-sr,nvfp4",
     "nvfp4-sr-rht16,nvfp4-rht16"),
    (dict(four_over_six="weights"), "nvfp4,nvfp4-16x16-4o6",
     "nvfp4-sr,nvfp4-16x16-4o6", "nvfp4-sr-rht16,nvfp4-rht16"),
])
def test_ablation_flags_change_the_traced_recipe(flags, fprop, dgrad, wgrad):
  r = _report(**flags)
  assert _formats(r, "fprop") == {fprop}
  assert _formats(r, "dgrad") == {dgrad}
  assert _formats(r, "wgrad") == {wgrad}
  assert r.count("fprop") == 4  # The paper preset: block_2 of 4.


def test_all_quantized_quantizes_every_projection():
  assert _report(all_quantized=True).count("fprop") == 16
  assert _report(precision="mxfp4", all_quantized=True,
                 sr=False).count("wgrad") == 16


def test_cli_applies_ablations_to_the_precisions_they_concern():
  args = cli.build_parser().parse_args(
      ["--compare", "bf16,nvfp4,mxfp4", "--no-rht", "--no-sr",
       "--remat", "quantized", "--attention", "reference",
       "--residuals", "values"])
  cfgs = {c.precision: c for c in cli.make_configs(
      args, ["bf16", "nvfp4", "mxfp4"])}
  assert cfgs["bf16"].rht and cfgs["bf16"].sr
  assert not cfgs["nvfp4"].rht and not cfgs["nvfp4"].sr
  assert cfgs["mxfp4"].rht and not cfgs["mxfp4"].sr
  assert [c.residuals for c in cfgs.values()] == ["codes", "values", "codes"]
  assert build.run_recipe(cfgs["nvfp4"]).residuals == "values"
  assert all(c.remat == "quantized" and c.attention == "reference"
             for c in cfgs.values())
  with pytest.raises(cli.UsageError, match="--no-2d has no effect"):
    cli.make_configs(cli.build_parser().parse_args(
        ["--precision", "mxfp4", "--no-2d"]), ["mxfp4"])
  with pytest.raises(ValueError, match="--four-over-six has no effect"):
    TrainConfig(precision="bf16", four_over_six="all")
  with pytest.raises(ValueError, match="--residuals has no effect"):
    TrainConfig(precision="mxfp4", residuals="values")


def _remat_reference_trainer():
  cfg = TrainConfig(preset="tiny", steps=2, batch_size=4, seq_len=32,
                    remat="quantized", attention="reference",
                    diagnostics=False)
  return Trainer(cfg, small_corpus(), MODEL.replace(
      remat="quantized", attention="reference"))


def test_remat_and_attention_reach_the_model():
  trainer = _remat_reference_trainer()
  text = str(jax.make_jaxpr(trainer.fns.train_step)(
      trainer.init_state(), trainer.batcher.batch(0).reshape(1, 4, 33)))
  assert "checkpoint" in text or "remat" in text


# Compiling the rematerialized step costs the fast tier ~18 s; the policy's
# gradients and residuals are checked there by tests/test_remat.py.
@pytest.mark.slow
def test_remat_and_reference_attention_train():
  trainer = _remat_reference_trainer()
  state, m = trainer.train_step(trainer.init_state(),
                                trainer.batcher.batch(0).reshape(1, 4, 33))
  assert bool(m["finite"])


def test_bf16_layers_keep_exactly_those_layers_in_high_precision():
  """`--bf16-layers` (the rules train.sensitivity suggests) replaces the
  paper preset: the named layers run their three GEMMs in BF16, all others
  quantized."""
  r = _report(bf16_layers="block_0/attn/qkv,block_3/mlp/down")
  assert r.count("fprop") == 14 and r.count("wgrad") == 14
  kept = {g.layer for g in r.high_precision if "recipe" in g.reason}
  assert kept == {"block_0/attn/qkv", "block_3/mlp/down"}
  with pytest.raises(ValueError, match="'block_4/mlp/up' is not a layer of "
                     "this 4-block model"):
    _report(bf16_layers="block_4/mlp/up")
  for bad in ("block_0/attn", "head", "", "block_0/attn/qkv,"):
    with pytest.raises(ValueError, match="is not a projection of the GPT"):
      TrainConfig(bf16_layers=bad)
  with pytest.raises(ValueError, match="contradict"):
    TrainConfig(bf16_layers="block_0/attn/qkv", all_quantized=True)
