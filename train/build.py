"""From a `TrainConfig` to what a run builds: the model's configuration and
the precision rules (the paper's preset, its ablations, `bf16_layers`, the
late switch).

`train.loop` re-exports these names; `Trainer` calls them.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax
from models import GPTConfig
from models import preset as model_preset
from train.config import TrainConfig

__all__ = ["default_dtype", "imported_init_state", "make_rules",
           "model_config", "run_recipe"]


def default_dtype() -> str:
  """bfloat16 on accelerators; float32 on CPU (bf16 is emulated there)."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
  """The `GPTConfig` of `cfg.preset` for a corpus of `vocab_size` ids; with
  `cfg.init_from`, the HF checkpoint's (its own vocabulary, which must
  cover the corpus' ids; the run's dtype, attention and remat).

  Raises:
    ValueError: a checkpoint the GPT cannot load (`models.load_hf`'s
      errors), or a corpus of more token ids than its vocabulary.
  """
  if cfg.init_from is not None:
    from models.hf import config_from_hf  # pylint: disable=g-import-not-at-top
    from models.hf_import import checkpoint_files  # pylint: disable=g-import-not-at-top
    try:
      checkpoint_files(cfg.init_from)
    except FileNotFoundError as e:
      raise ValueError(f"init_from: {e}") from None
    with open(os.path.join(cfg.init_from, "config.json")) as f:
      mcfg = config_from_hf(json.load(f))
    if vocab_size > mcfg.vocab_size:
      raise ValueError(
          f"init_from {cfg.init_from!r}: the checkpoint embeds "
          f"{mcfg.vocab_size} token ids but the corpus uses {vocab_size}; "
          f"tokenize the data with the checkpoint's tokenizer.")
    return mcfg.replace(dtype=cfg.dtype or default_dtype(),
                        attention=cfg.attention, remat=cfg.remat)
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


def imported_init_state(trainer: Any) -> Callable[[], Any]:
  """`trainer.init_state` for a run with `init_from`: a function returning
  the state before step 0 whose FP32 master weights are the checkpoint's
  weights and whose parameters are them cast to the model's parameter
  dtypes, placed as the trainer's state shardings. The checkpoint is read
  when the function is called (a resumed or exported run never reads it).

  The function raises ValueError for checkpoint tensors that do not match
  the model (each named).
  """
  from models.hf import from_hf_tensors  # pylint: disable=g-import-not-at-top
  from models.hf_import import checkpoint_files  # pylint: disable=g-import-not-at-top
  from models.hf_import import read_safetensors  # pylint: disable=g-import-not-at-top
  from train.step import TrainState  # pylint: disable=g-import-not-at-top
  directory = trainer.cfg.init_from

  def build(master, like):
    params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, like.params)
    # Copies: the master would alias FP32 params, and the step donates.
    opt_state = jax.tree.map(jnp.copy, trainer.optimizer.init(master))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=opt_state, skipped=jnp.zeros((), jnp.int32))

  def spec(x):
    return (x.shape, np.dtype(x.dtype))

  def init_state():
    master = from_hf_tensors(trainer.model_cfg.replace(dtype="float32"),
                             read_safetensors(checkpoint_files(directory)))
    like = jax.eval_shape(trainer.fns.init_state)
    make = functools.partial(build, like=like)
    if (jax.tree.map(spec, jax.eval_shape(make, master))
        != jax.tree.map(spec, like)):
      raise ValueError(f"init_from {directory!r}: the imported train state "
                       f"differs from the trainer's in shape or dtype (a bug "
                       f"in train.build).")
    mr = trainer.mesh_rules
    if mr is None:
      return jax.jit(make)(master)
    in_shardings = mr.shardings(mr.param_specs(master))
    # Every process holds the whole host array and gives its devices' parts.
    master = jax.tree.map(
        lambda x, sh: jax.make_array_from_callback(x.shape, sh,
                                                   lambda idx: x[idx]),
        master, in_shardings)
    return jax.jit(make, in_shardings=(in_shardings,),
                   out_shardings=trainer.state_shardings)(master)
  return init_state
