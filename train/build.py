"""From a `TrainConfig` to what a run builds: the model's configuration and
the precision rules (the paper's preset, its ablations, `bf16_layers`, the
late switch).

`train.loop` re-exports these names; `Trainer` calls them.
"""

from __future__ import annotations

import re

import jax

import nvfp4_jax
from models import GPTConfig
from models import preset as model_preset
from train.config import TrainConfig

__all__ = ["default_dtype", "make_rules", "model_config", "run_recipe"]


def default_dtype() -> str:
  """bfloat16 on accelerators; float32 on CPU (bf16 is emulated there)."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
  """The `GPTConfig` of `cfg.preset` for a corpus of `vocab_size` ids."""
  overrides = dict(vocab_size=vocab_size, dtype=cfg.dtype or default_dtype(),
                   attention=cfg.attention, remat=cfg.remat)
  if cfg.mlp is not None:
    overrides["mlp"] = cfg.mlp
  return model_preset(cfg.preset, **overrides)


def make_rules(cfg: TrainConfig, num_layers: int) -> nvfp4_jax.PrecisionRules:
  """The precision rules of `cfg.precision`.

  "bf16": every projection in high precision. Otherwise the paper's preset
  (first 2 and last ~15% of blocks in BF16; every block with
  `all_quantized`; exactly `bf16_layers` when given) with that format
  elsewhere, its ablations applied, and the late switch if configured.
  """
  if cfg.precision == "bf16":
    return nvfp4_jax.PrecisionRules.high_precision()
  switch = None
  if cfg.late_switch_step is not None:
    switch = nvfp4_jax.LateSwitch(step=cfg.late_switch_step,
                                  mode=cfg.late_switch_mode)
  recipe = run_recipe(cfg)
  if cfg.bf16_layers is not None:
    paths = cfg.bf16_layers.split(",")
    deep = [p for p in paths if p.startswith("block_")
            and int(p.split("/")[0][len("block_"):]) >= num_layers]
    if deep:
      raise ValueError(f"bf16_layers: {deep[0]!r} is not a layer of this "
                       f"{num_layers}-block model; blocks are numbered 0 to "
                       f"{num_layers - 1}.")
    return nvfp4_jax.PrecisionRules(
        default=recipe, late_switch=switch,
        rules=tuple((f"^{re.escape(p)}$", nvfp4_jax.Recipe.bf16())
                    for p in paths))
  if cfg.all_quantized:
    return nvfp4_jax.PrecisionRules(default=recipe, late_switch=switch)
  return nvfp4_jax.paper_rules(num_layers, recipe=recipe, late_switch=switch)


def run_recipe(cfg: TrainConfig) -> nvfp4_jax.Recipe:
  """The quantized layers' recipe: the precision with the run's ablations."""
  if cfg.precision == "nvfp4":
    return nvfp4_jax.Recipe.nvfp4(rht=cfg.rht, stochastic_rounding=cfg.sr,
                                  two_d_weights=cfg.two_d,
                                  four_over_six=cfg.four_over_six,
                                  residuals=cfg.residuals)
  if cfg.precision == "mxfp4":
    return nvfp4_jax.Recipe.mxfp4(stochastic_rounding=cfg.sr)
  return nvfp4_jax.Recipe.from_name(cfg.precision)
