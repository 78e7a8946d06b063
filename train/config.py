"""The training run's configuration and the per-preset defaults."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from models import PRESETS
from models import MLP_KINDS
from models.gpt import ATTENTION_KINDS
from models.gpt import REMAT_KINDS
from nvfp4_jax.sharding.mesh import AMAX_SCOPES
from nvfp4_jax.sharding.mesh import PARTIAL_SUMS
from nvfp4_jax.sharding.mesh import WGRAD_SCHEDULES
from nvfp4_jax.sharding.mesh import WGRAD_SUMS
from nvfp4_jax.core.recipe import FOUR_OVER_SIX_MODES
from nvfp4_jax.core.recipe import RESIDUALS
from nvfp4_jax.core.recipe import check_field

PRECISIONS = ("bf16", "nvfp4", "mxfp4", "mxfp8")

# The recipe ablations, once: CLI flag -> (TrainConfig field, the value the
# flag sets (None: the flag's own value), the precisions it concerns). The CLI
# builds its flags' effect from it and `TrainConfig` rejects an ablation of a
# precision it does not concern.
ABLATIONS: dict[str, tuple[str, Any, tuple[str, ...]]] = {
    "no_sr": ("sr", False, ("nvfp4", "mxfp4")),
    "no_rht": ("rht", False, ("nvfp4",)),
    "no_2d": ("two_d", False, ("nvfp4",)),
    "four_over_six": ("four_over_six", None, ("nvfp4",)),
    "residuals": ("residuals", None, ("nvfp4",)),
    "all_quantized": ("all_quantized", True, ("nvfp4", "mxfp4", "mxfp8")),
    "bf16_layers": ("bf16_layers", None, ("nvfp4", "mxfp4", "mxfp8")),
}
# The step counter is an int32 on the device; seeds feed NumPy's and JAX's
# generators as uint32.
MAX_STEPS = 2**31 - 1
MAX_SEED = 2**32 - 1
SWITCH_MODES = ("all", "forward")
# The GPT's projections, as layer paths (`--bf16-layers`).
LAYER_PATH = r"block_\d+/(attn/(qkv|out)|mlp/(up|down)|moe/experts/(up|down))"

# Steps, global batch, sequence length, micro-batches and peak learning rate
# per model size. `tiny` is sized for two CPU cores (both precisions of the
# default comparison in under five minutes); the rest are starting points for
# one 80 GB GPU with the fused (cuDNN) attention. `base` runs micro-batches of
# 64 x 1024 tokens: on the H100, BF16 at 32% MFU with 29.7 GB of XLA
# temporaries (16: 29%, 7.5 GB; BENCHMARKS.md). `large`'s micro-batch of 8
# predates the fused attention (the FP32 scores of `micro x heads x seq^2`
# bounded it) and is not re-measured. With `--attention reference` raise
# `--grad-accum` to keep those scores within memory.
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "tiny": dict(steps=200, batch_size=16, seq_len=128, lr=3e-3),
    "small": dict(steps=5000, batch_size=64, seq_len=512, lr=1.5e-3),
    "base": dict(steps=20000, batch_size=128, seq_len=1024, grad_accum=2,
                 lr=6e-4),
    "large": dict(steps=40000, batch_size=256, seq_len=1024, grad_accum=32,
                  lr=3e-4),
    "moe-tiny": dict(steps=200, batch_size=16, seq_len=128, lr=3e-3),
    "moe-small": dict(steps=5000, batch_size=64, seq_len=512, lr=1.5e-3),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Everything that determines a run's numbers (saved with its checkpoints).

  The fields' defaults are the `tiny` preset's training settings whatever
  `preset` says; `TrainConfig.for_preset(name, **overrides)` starts from
  preset `name`'s (`PRESET_TRAINING`: steps, batch, learning rate).

  Attributes:
    preset: model size, a key of `models.PRESETS`.
    precision: "bf16" (every projection in high precision), "nvfp4" (the
      paper's recipe with its selective-precision preset), "mxfp4" or
      "mxfp8" (the same preset with that format).
    steps: optimizer steps.
    batch_size: sequences per optimizer step (all micro-batches together).
    seq_len: tokens per sequence.
    grad_accum: micro-batches per step; `batch_size` must divide evenly.
    lr: peak learning rate of the warmup-stable-decay schedule.
    warmup_steps: linear warmup length; None = 5% of `steps`.
    decay_fraction: share of the run spent in the final linear decay to 0.
    weight_decay: AdamW decoupled weight decay (matrices only).
    b1, b2: AdamW moment decay rates.
    clip_norm: global gradient-norm clip.
    seed: seeds the initialization, the data order and stochastic rounding.
    eval_every: steps between validation evaluations (and at the end).
    eval_batches: validation batches per evaluation.
    ckpt_every: steps between checkpoints (and at the end).
    diagnostics: sample per-layer quantization diagnostics on the validation
      batches at every evaluation.
    late_switch_step: from this step on, quantized layers run in BF16
      (paper Appendix D); None = never.
    late_switch_mode: "all" GEMMs or only the "forward" one.
    mlp: "swiglu" or "relu2"; None = the preset's.
    dtype: compute dtype "float32"/"bfloat16"; None = bfloat16 on GPU/TPU,
      float32 on CPU (where bf16 arithmetic is emulated and slow).
    sr, rht, two_d: the recipe's stochastic rounding of gradients, Random
      Hadamard Transform of the Wgrad operands, 16x16 weight scales (the
      ablations: TE's disable_* flags). `sr` applies to mxfp4 too.
    four_over_six: Four-over-Six block scaling on "none", "weights",
      "activations" or "all" NVFP4 operands.
    all_quantized: quantize every projection (no BF16 blocks): the paper's
      "everything in FP4" ablation, instead of its selective-precision preset.
    bf16_layers: comma-separated layer paths (e.g.
      "block_0/attn/qkv,block_5/mlp/down")
      kept in BF16 instead of the paper preset's blocks, every other
      projection quantized: the rules `python -m train.sensitivity` suggests.
    attention: "fused" (`jax.nn.dot_product_attention`, cuDNN on GPU) or
      "reference" (explicit FP32 scores).
    remat: "none", "quantized" (blocks save only the quantized residuals of
      their NVFP4 layers and recompute the rest; `nvfp4_jax.remat_policy`)
      or "full" (blocks save only their inputs and recompute everything).
    residuals: "codes" or "values": how NVFP4 layers save the operands their
      backward pass multiplies (`nvfp4_jax.Recipe`: values skip the
      dequantize pass where the GEMM is emulated, at bf16's memory).
    tp_partial_sums: on a mesh with a `model` axis, the dtype tensor
      parallelism sums partial results in: "float32" or "output"
      (`nvfp4_jax.MeshRules(partial_sums=...)`).
    sequence_parallel: on a mesh with a `model` axis of more than one
      device, sequence parallelism
      (`nvfp4_jax.MeshRules(sequence_parallel=True)`): the activations
      between the tensor-parallel layers split over `model` too; the same
      result.
    collective_matmul: with `sequence_parallel`, the quantized layers'
      gathers and reduce-scatters over `model` as rings beside their GEMMs
      (`nvfp4_jax.MeshRules(collective_matmul=True)`).
    amax: on a mesh, the activations' and gradients' tensor amax: "global"
      (the one-device run's quantization) or "local" (each token shard's,
      as a data-parallel micro-batch; `nvfp4_jax.MeshRules(amax=...)`).
    wgrad_schedule: with an `fsdp` mesh axis, when each layer's weight
      gradient is computed: "layer" (with its input gradient) or "xla"
      (where XLA's scheduler puts it;
      `nvfp4_jax.MeshRules(wgrad_schedule=...)`).
    wgrad_sums: on a mesh that splits the batch, the dtype the NVFP4
      layers' weight gradients are summed in across devices: "float32"
      (the one-device run's gradients, rounded once) or "bfloat16" (half
      the bytes; `nvfp4_jax.MeshRules(wgrad_sums=...)`).
    tokenizer: the path of the HF tokenizer that made the run's token file
      (a `tokenizer.json`, or a directory holding one), taken from the
      file's metadata (`train.token_file`); None for byte-level data.
      `Trainer` fills it in from the corpus; export copies the tokenizer
      files from it.
    init_from: a HF checkpoint directory (`models.load_hf`: Llama, Mistral,
      Mixtral) to continue training from: the model's configuration is the
      checkpoint's (not `preset`'s, which then only sets the training
      defaults; `mlp` must stay None) and its weights the initial
      parameters and FP32 master weights. None: a fresh `preset` model.
  """

  preset: str = "tiny"
  precision: str = "nvfp4"
  steps: int = 200
  batch_size: int = 16
  seq_len: int = 128
  grad_accum: int = 1
  lr: float = 3e-3
  warmup_steps: int | None = None
  decay_fraction: float = 0.2
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  seed: int = 0
  eval_every: int = 50
  eval_batches: int = 4
  ckpt_every: int = 100
  diagnostics: bool = True
  late_switch_step: int | None = None
  late_switch_mode: str = "all"
  mlp: str | None = None
  dtype: str | None = None
  sr: bool = True
  rht: bool = True
  two_d: bool = True
  four_over_six: str = "none"
  all_quantized: bool = False
  bf16_layers: str | None = None
  attention: str = "fused"
  remat: str = "none"
  residuals: str = "codes"
  tp_partial_sums: str = "float32"
  sequence_parallel: bool = False
  collective_matmul: bool = False
  amax: str = "global"
  wgrad_schedule: str = "layer"
  wgrad_sums: str = "float32"
  tokenizer: str | None = None
  init_from: str | None = None

  def __post_init__(self):
    # Types first: "false" is a truthy string and True an int in Python.
    for name, kind, optional in _FIELD_KINDS:
      check_field("TrainConfig", name, getattr(self, name), kind,
                  optional=optional, example=_FIELD_DEFAULTS.get(name))
    if self.preset not in PRESETS:
      raise ValueError(
          f"unknown preset {self.preset!r}; use one of {list(PRESETS)}.")
    if self.precision not in PRECISIONS:
      raise ValueError(
          f"unknown precision {self.precision!r}; use one of {PRECISIONS}.")
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every",
                 "eval_batches", "ckpt_every"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    if self.batch_size % self.grad_accum:
      raise ValueError(
          f"batch_size={self.batch_size} is not divisible by grad_accum="
          f"{self.grad_accum}; each micro-batch must hold the same number of "
          f"sequences.")
    if self.tokenizer is not None and not self.tokenizer.strip():
      raise ValueError("tokenizer '' is an empty path; give a tokenizer.json "
                       "or a directory holding one, or None for bytes.")
    if self.collective_matmul and not self.sequence_parallel:
      raise ValueError(
          "collective_matmul=True needs sequence_parallel=True (the rings "
          "run over the token shards it makes): pass both "
          "(--sequence-parallel --collective-matmul).")
    if self.steps > MAX_STEPS:
      raise ValueError(f"steps={self.steps} exceeds {MAX_STEPS}, the range of "
                       f"the int32 step counter; train fewer steps.")
    for name in ("lr", "clip_norm"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number, got "
                         f"{v!r}.")
    if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
      raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got "
                       f"{self.seed!r}.")
    if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps), got "
                       f"{self.warmup_steps}.")
    if not 0.0 <= self.decay_fraction <= 1.0:
      raise ValueError(f"decay_fraction must be in [0, 1], got "
                       f"{self.decay_fraction}.")
    if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
      raise ValueError(f"weight_decay must be a finite number >= 0, got "
                       f"{self.weight_decay!r}.")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (an AdamW moment decay "
                         f"rate, e.g. 0.9), got {getattr(self, name)!r}.")
    if self.late_switch_step is not None and not (
        0 <= self.late_switch_step <= self.steps):
      raise ValueError(
          f"late_switch_step={self.late_switch_step} is outside the run "
          f"[0, {self.steps}].")
    if self.late_switch_mode not in SWITCH_MODES:
      raise ValueError(f"unknown late_switch_mode {self.late_switch_mode!r}; "
                       f"use one of {SWITCH_MODES}.")
    if self.init_from is not None:
      if not self.init_from.strip():
        raise ValueError("init_from is an empty path; give a HF checkpoint "
                         "directory or None.")
      if self.mlp is not None:
        raise ValueError(
            f"mlp={self.mlp!r} conflicts with init_from={self.init_from!r}: "
            f"the model's configuration is the checkpoint's; drop --mlp.")
    if self.mlp is not None and self.mlp not in MLP_KINDS:
      raise ValueError(f"unknown mlp {self.mlp!r}; use one of {MLP_KINDS}.")
    if self.dtype not in (None, "float32", "bfloat16"):
      raise ValueError(f"unknown dtype {self.dtype!r}; use float32 or "
                       f"bfloat16.")
    if self.four_over_six not in FOUR_OVER_SIX_MODES:
      raise ValueError(f"unknown four_over_six {self.four_over_six!r}; use "
                       f"one of {FOUR_OVER_SIX_MODES}.")
    for flag, (field, _, formats) in ABLATIONS.items():
      if (getattr(self, field) != _FIELD_DEFAULTS[field]
          and self.precision not in formats):
        raise ValueError(
            f"--{flag.replace('_', '-')} has no effect with precision "
            f"{self.precision!r}; use it with {' or '.join(formats)}.")
    if self.bf16_layers is not None:
      if self.all_quantized:
        raise ValueError("--bf16-layers and --all-quantized contradict each "
                         "other; give one of them.")
      bad = [p for p in self.bf16_layers.split(",")
             if not re.fullmatch(LAYER_PATH, p)]
      if bad or not self.bf16_layers:
        raise ValueError(
            f"bf16_layers {self.bf16_layers!r}: {bad[0] if bad else ''!r} is "
            f"not a projection of the GPT; give comma-separated paths like "
            f"block_0/attn/qkv,block_5/mlp/down (as python -m "
            f"train.sensitivity prints them).")
    for name, choices in (("attention", ATTENTION_KINDS),
                          ("remat", REMAT_KINDS), ("residuals", RESIDUALS),
                          ("tp_partial_sums", PARTIAL_SUMS),
                          ("amax", AMAX_SCOPES),
                          ("wgrad_schedule", WGRAD_SCHEDULES),
                          ("wgrad_sums", WGRAD_SUMS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"unknown {name} {getattr(self, name)!r}; use one "
                         f"of {choices}.")

  @property
  def micro_batch(self) -> int:
    return self.batch_size // self.grad_accum

  @property
  def warmup(self) -> int:
    if self.warmup_steps is not None:
      return self.warmup_steps
    return max(1, self.steps // 20) if self.steps > 1 else 0

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def for_preset(cls, preset: str = "tiny", **overrides) -> "TrainConfig":
    """The preset's training defaults, with `overrides` (None values ignored)."""
    if preset not in PRESET_TRAINING:
      raise ValueError(
          f"unknown preset {preset!r}; use one of {list(PRESET_TRAINING)}.")
    fields = dict(PRESET_TRAINING[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    steps = fields["steps"]
    # Evaluate (with diagnostics) and checkpoint 5 times per run by default, at
    # least every 1000 steps.
    interval = max(1, min(steps // 5, 1000))
    for name in ("eval_every", "ckpt_every"):
      fields.setdefault(name, interval)
    return cls(preset=preset, **fields)


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
# Each field's kind for `check_field` (and whether None is allowed).
_FIELD_KINDS = tuple(
    (f.name, {"bool": "bool", "int": "int", "float": "number",
              "str": "str"}[f.type.split(" | ")[0]], "None" in f.type)
    for f in dataclasses.fields(TrainConfig))
