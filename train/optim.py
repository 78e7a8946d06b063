"""The optimizer: AdamW on FP32 master weights, clipping, a WSD schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import nvfp4_jax

from train.config import TrainConfig


def wsd_schedule(peak: float, total: int, warmup: int,
                 decay_fraction: float) -> optax.Schedule:
  """Warmup-stable-decay: linear warmup to `peak`, flat, linear decay to 0.

  The decay covers the last `decay_fraction * total` steps, as in the paper's
  runs (and MiniCPM's WSD); count `c` gives the learning rate of step `c`.
  """
  decay = int(round(decay_fraction * total))
  decay_start = max(warmup, total - decay)

  def schedule(count):
    c = jnp.asarray(count, jnp.float32)
    warm = peak * (c + 1.0) / max(warmup, 1)
    down = peak * jnp.clip((total - c) / max(total - decay_start, 1), 0.0, 1.0)
    return jnp.where(c < warmup, warm, jnp.where(c < decay_start, peak, down))
  return schedule


def decay_mask(params):
  """Weight decay on matrices (kernels, embedding), not on norm scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation,
                                                optax.Schedule]:
  """`master_weights(chain(clip_by_global_norm, adamw))` and its schedule.

  The clip and AdamW run on the FP32 master copy (and FP32 gradients) inside
  the wrapper; the returned updates move the model's parameters to the new
  master cast to their dtype.
  """
  schedule = wsd_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.decay_fraction)
  inner = optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
  return nvfp4_jax.master_weights(inner), schedule
