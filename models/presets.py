"""Size presets of the GPT decoder and their parameter counts.

Byte-level vocabulary (256), so the embedding and head are small and the
counts are almost all transformer blocks (about `12 * d_model^2` per block with
SwiGLU at `d_ff ~ 8/3 d_model`).

| preset | d_model | layers | heads | d_ff | parameters |
| ------ | ------- | ------ | ----- | ---- | ---------- |
| tiny   | 128     | 6      | 4     | 352  | ~1.2M      |
| small  | 512     | 8      | 8     | 1376 | ~25M       |
| base   | 768     | 18     | 12    | 2048 | ~127M      |
| large  | 1024    | 28     | 16    | 2752 | ~354M      |
| moe-tiny  | 64   | 4      | 4     | 4 experts x 128, top-2 | ~0.5M |
| moe-small | 512  | 8      | 8     | 8 experts x 704, top-2 | ~78M (~26M active) |

`tiny` trains its 200 steps on two CPU cores in one to two minutes per
precision; the others are for GPUs (`python -m train --preset base`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax

from models.gpt import GPT, GPTConfig

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, num_layers=6, num_heads=4, d_ff=352),
    "small": GPTConfig(d_model=512, num_layers=8, num_heads=8, d_ff=1376),
    "base": GPTConfig(d_model=768, num_layers=18, num_heads=12, d_ff=2048),
    "large": GPTConfig(d_model=1024, num_layers=28, num_heads=16, d_ff=2752),
    # Mixtures of SwiGLU experts, top-2: `moe-tiny` for CPUs (and CI),
    # `moe-small` with about `small`'s active parameters per token (two
    # experts of width 704 against one MLP of 1376).
    "moe-tiny": GPTConfig(d_model=64, num_layers=4, num_heads=4, d_ff=128,
                          num_experts=4, top_k=2),
    "moe-small": GPTConfig(d_model=512, num_layers=8, num_heads=8, d_ff=704,
                           num_experts=8, top_k=2),
}


def preset(name: str, **overrides) -> GPTConfig:
  """The `GPTConfig` of preset `name`, with fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; use one of {list(PRESETS)}.")
  return PRESETS[name].replace(**overrides)


@functools.lru_cache(maxsize=64)  # The CLI prints it twice per run.
def param_count(cfg: GPTConfig) -> int:
  """Number of parameters of `GPT(cfg)`, from shapes only (nothing allocated)."""
  # Traced with every layer in high precision: the same parameters, without
  # tracing the quantizers (much faster for the large presets).
  hp = nvfp4_jax.PrecisionRules.high_precision()

  def init():
    with nvfp4_jax.precision_rules(hp):
      return GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))
  shapes = jax.eval_shape(init)["params"]  # Not the MoE losses it sows.
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def format_count(n: int) -> str:
  """`1234567 -> "1.23M"`."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return str(n)


def preset_table() -> str:
  """A printable table of the presets with their parameter counts."""
  rows = ["preset  d_model  layers  heads  d_ff   params"]
  for name, cfg in PRESETS.items():
    rows.append(f"{name:<7} {cfg.d_model:>7} {cfg.num_layers:>7} "
                f"{cfg.num_heads:>6} {cfg.d_ff:>5}  "
                f"{format_count(param_count(cfg)):>7}")
  return "\n".join(rows)
