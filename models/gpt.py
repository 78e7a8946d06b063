"""A GPT-style decoder whose every projection is an `NVFP4Dense`.

Layout per block (pre-norm, no biases anywhere):

    x = x + attn/out( causal_attention( rotary( attn/qkv( RMSNorm(x) ) ) ) )
    x = x + mlp/down( act( mlp/up( RMSNorm(x) ) ) )

Attention is grouped-query where `num_kv_heads < num_heads`, rotary
embeddings optionally with Llama 3's frequency scaling (`RopeScaling`):
what Llama, Mistral and Mixtral checkpoints need (`models.hf`).

Precision follows NVFP4_SPEC section 5. The four projections of each block
(`block_{i}/attn/qkv`, `block_{i}/attn/out`, `block_{i}/mlp/up`,
`block_{i}/mlp/down`) are `NVFP4Dense` layers without a fixed recipe: each
takes its recipe from the active `nvfp4_jax.PrecisionRules` by that path, so
`paper_rules(num_layers)` keeps the first two and the last ~15% of blocks in
BF16. Everything else is high precision by construction: the token embedding
(an `nn.Embed` whose gradient is summed in FP32: `embed_lookup`), the
output head (an untied `nn.Dense`, or with `tie_embeddings` the embedding's
transpose, in FP32), RMSNorm, rotary embeddings, the attention
score and value batched GEMMs (FP32 accumulation) and the softmax run in
FP32, the MLP non-linearity in FP32.

The SwiGLU MLP fuses its gate and up projections into one `mlp/up` GEMM of
width `2 * d_ff` (one quantization of the shared input instead of two).

The fused kernels' columns are laid out so that tensor parallelism needs no
reshard (`GPTConfig.fused_layout="interleaved"`, the default): `attn/qkv`'s
`(num_heads + 2 * kv_heads) * head_dim` columns are `[kv_heads, (q_0 ...
q_{g-1}, k, v), head_dim]` with `g = num_heads / kv_heads` (Megatron's
query groups; `[heads, (q, k, v), head_dim]` without grouped-query
attention) and
`mlp/up`'s `2 * d_ff` columns are `[d_ff / 16, (gate, up), 16]` (gate and up
interleaved in blocks of `GATE_UP_BLOCK` = 16 columns, one NVFP4 tile). A
contiguous split of the columns over the `model` mesh axis (Megatron's
column parallelism) then gives each device whole heads with their q, k and
v, and matching gate and up columns, whose product is the contiguous slice
of the MLP's hidden features that `mlp/down`'s row split expects. The
layout of earlier versions, `[q | k | v]` (`[(q, k, v), heads, head_dim]`
without grouped-query attention) and `[(gate, up), d_ff]`, is
`fused_layout="concatenated"`; `convert_fused_layout`
permutes a parameter (or train state) tree between the two, whole 16-column
tiles at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from nvfp4_jax.flax.moe import NVFP4MoE
from nvfp4_jax.core.recipe import check_field

MLP_KINDS = ("swiglu", "relu2")
ATTENTION_KINDS = ("fused", "reference")
REMAT_KINDS = ("none", "quantized", "full")
FUSED_LAYOUTS = ("interleaved", "concatenated")
# Gate and up columns alternate in blocks this wide under the "interleaved"
# layout: one NVFP4 16x16 weight tile (and 1x16 block) wide, so the layout
# is a permutation of whole tiles and any column split that keeps tiles
# whole keeps gate and up paired.
GATE_UP_BLOCK = 16
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_choice(name: str, value, choices) -> None:
  """Raises a ValueError naming `name`, its `value` and the `choices`."""
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; use one of {tuple(choices)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama 3's rotary frequency scaling (HF `rope_type: "llama3"`).

  Frequencies whose wavelength exceeds `original_max_position_embeddings /
  low_freq_factor` are divided by `factor`, those below `... /
  high_freq_factor` kept, and those between interpolated smoothly
  (`rope_inv_freq`, as transformers' `_compute_llama3_parameters`).

  Attributes:
    factor: the divisor of the low frequencies (8 in Llama 3.1).
    low_freq_factor: 1 in Llama 3.1.
    high_freq_factor: 4 in Llama 3.1; larger than `low_freq_factor`.
    original_max_position_embeddings: the pretraining context (8192).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"):
      v = getattr(self, name)
      check_field("RopeScaling", name, v, "number", example=8.0)
      if not (math.isfinite(v) and v > 0):
        raise ValueError(f"RopeScaling.{name} must be a positive finite "
                         f"number, got {v!r}.")
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          f"RopeScaling: high_freq_factor={self.high_freq_factor!r} must "
          f"exceed low_freq_factor={self.low_freq_factor!r} (the smoothing "
          f"divides by their difference).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
  """Shape and numerics of the decoder.

  Attributes:
    vocab_size: token ids `[0, vocab_size)`; 256 for bytes.
    d_model: residual width, a multiple of 32 (the MX block) so every
      projection can be quantized.
    num_layers: number of blocks, named `block_0 ... block_{n-1}`.
    num_heads: attention heads; `d_model / num_heads` must be even (rotary).
    num_kv_heads: key/value heads (grouped-query attention): None for
      `num_heads`; else a divisor of `num_heads`, each key/value head
      shared by `num_heads / num_kv_heads` query heads (`kv_heads`).
    d_ff: MLP hidden width, a multiple of 32.
    mlp: "swiglu" (`silu(gate) * up`) or "relu2" (squared ReLU, as in the
      paper's Nemotron models).
    rope_base: rotary frequency base (HF `rope_theta`).
    rope_scaling: None, or Llama 3's frequency scaling (`RopeScaling`, or
      a dict of its fields, as `dataclasses.asdict` saves it).
    tie_embeddings: the output head is the token embedding's transpose
      (logits `final_norm(x) @ embed.embedding.T` in FP32; the parameter
      tree then has no `head`).
    dtype: compute dtype of activations and parameters, "float32" or
      "bfloat16" (the optimizer keeps FP32 master weights either way).
    norm_eps: RMSNorm epsilon (HF `rms_norm_eps`).
    attention: "fused" (`jax.nn.dot_product_attention`: cuDNN flash attention
      on GPU for bf16/fp16 activations, XLA elsewhere; see
      `fused_attention_implementation`) or "reference" (`causal_attention`:
      explicit FP32 scores; slower, materializes `[batch, heads, seq,
      seq]`).
    remat: "none" (autodiff saves what it needs) or "quantized": each block
      is rematerialized and saves only the quantized residuals of its NVFP4
      layers (`nvfp4_jax.remat_policy`), recomputing the rest in the
      backward pass. Layers kept in high precision save nothing. "full":
      each block saves only its input and recomputes everything, the NVFP4
      layers' quantization included (the same values: the rounding keys
      are inputs), for the least memory at the most recomputation.
    num_experts: 0 for the dense MLP; else every block's MLP is a mixture
      of `num_experts` SwiGLU experts of hidden width `d_ff`
      (`nvfp4_jax.flax.moe.NVFP4MoE`, named `block_{i}/moe`, its expert
      GEMMs `block_{i}/moe/experts/up` and `.../down`).
    top_k: experts per token (MoE).
    capacity_factor: None (dropless) or each expert's capacity factor.
    aux_loss_weight: the load-balancing loss's weight in the training loss
      (the mean over MoE blocks).
    fused_layout: the column order of the fused `attn/qkv` and SwiGLU
      `mlp/up` kernels. "interleaved" (default): qkv by query group,
      `[kv_heads, (q_0 ... q_{g-1}, k, v), head_dim]` (`[heads, (q, k, v),
      head_dim]` without grouped-query attention), and `[d_ff / 16, (gate, up), 16]`, so a
      contiguous column split over the `model` mesh axis gives each device
      whole heads and matching gate and up columns (no reshard inside
      attention or the MLP). "concatenated": `[q | k | v]` (`num_heads`,
      `kv_heads`, `kv_heads` heads) and `[(gate, up), d_ff]`, the layout of checkpoints written before it
      existed (`convert_fused_layout` converts between the two).
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  d_ff: int = 352
  mlp: str = "swiglu"
  rope_base: float = 10000.0
  dtype: str = "float32"
  norm_eps: float = 1e-6
  attention: str = "fused"
  remat: str = "none"
  num_experts: int = 0
  top_k: int = 2
  capacity_factor: float | None = None
  aux_loss_weight: float = 0.01
  fused_layout: str = "interleaved"
  num_kv_heads: int | None = None
  tie_embeddings: bool = False
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      # As `dataclasses.asdict` saved it in a run's config.
      object.__setattr__(self, "rope_scaling",
                         RopeScaling(**self.rope_scaling))
    if not (self.rope_scaling is None
            or isinstance(self.rope_scaling, RopeScaling)):
      raise TypeError(
          f"GPTConfig.rope_scaling must be None, a RopeScaling or a dict of "
          f"its fields, got {self.rope_scaling!r}.")
    check_field("GPTConfig", "tie_embeddings", self.tie_embeddings, "bool",
                example=False)
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
      check_field("GPTConfig", name, getattr(self, name), "int", example=128)
      if getattr(self, name) < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got "
                         f"{getattr(self, name)!r}.")
    for name in ("d_model", "d_ff"):
      if getattr(self, name) % 32:
        raise ValueError(
            f"GPTConfig.{name}={getattr(self, name)} is not a multiple of 32; "
            f"NVFP4 (blocks of 16) and MX (blocks of 32) quantize along it. "
            f"Round it to {32 * math.ceil(getattr(self, name) / 32)}.")
    if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
      raise ValueError(
          f"d_model={self.d_model} must split into num_heads={self.num_heads} "
          f"heads of even size (rotary rotates pairs of features).")
    if self.num_kv_heads is not None:
      check_field("GPTConfig", "num_kv_heads", self.num_kv_heads, "int",
                  example=self.num_heads)
      if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
        raise ValueError(
            f"GPTConfig.num_kv_heads={self.num_kv_heads!r} must divide "
            f"num_heads={self.num_heads} (each key/value head serves a "
            f"whole group of query heads); use a divisor of it or None.")
    if (self.kv_heads * self.head_dim) % 16:
      raise ValueError(
          f"GPTConfig: the key/value width num_kv_heads * head_dim = "
          f"{self.kv_heads} * {self.head_dim} = "
          f"{self.kv_heads * self.head_dim} is not a multiple of 16, so "
          f"attn/qkv's width (num_heads + 2 * num_kv_heads) * head_dim = "
          f"{self.qkv_width} is not a multiple of 32 (NVFP4 blocks of 16, "
          f"MX blocks of 32 run along it in the backward GEMMs); choose "
          f"num_kv_heads so that num_kv_heads * head_dim is a multiple of "
          f"16.")
    for name in ("rope_base", "norm_eps"):
      v = getattr(self, name)
      check_field("GPTConfig", name, v, "number", example=1e-6)
      if not (math.isfinite(v) and v > 0):
        raise ValueError(f"GPTConfig.{name} must be a positive finite "
                         f"number, got {v!r}.")
    check_field("GPTConfig", "num_experts", self.num_experts, "int",
                example=8)
    if self.num_experts < 0 or self.num_experts == 1:
      raise ValueError(
          f"GPTConfig.num_experts must be 0 (dense MLP) or at least 2, got "
          f"{self.num_experts!r}.")
    if self.num_experts:
      check_field("GPTConfig", "top_k", self.top_k, "int", example=2)
      if not 1 <= self.top_k <= self.num_experts:
        raise ValueError(
            f"GPTConfig.top_k must be in [1, num_experts={self.num_experts}], "
            f"got {self.top_k!r}.")
      if self.mlp != "swiglu":
        raise ValueError("GPTConfig: the MoE experts are SwiGLU; set "
                         "mlp='swiglu' with num_experts > 0.")
      if self.capacity_factor is not None and not self.capacity_factor > 0:
        raise ValueError(
            f"GPTConfig.capacity_factor must be positive or None (dropless), "
            f"got {self.capacity_factor!r}.")
    for name, choices in (("mlp", MLP_KINDS), ("attention", ATTENTION_KINDS),
                          ("remat", REMAT_KINDS), ("dtype", tuple(_DTYPES)),
                          ("fused_layout", FUSED_LAYOUTS)):
      check_field("GPTConfig", name, getattr(self, name), "str",
                  example=choices[0])
      check_choice(name, getattr(self, name), choices)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads: `num_kv_heads`, or `num_heads` where None."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def qkv_width(self) -> int:
    """Output width of the fused `attn/qkv` kernel."""
    return (self.num_heads + 2 * self.kv_heads) * self.head_dim

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **changes) -> "GPTConfig":
    return dataclasses.replace(self, **changes)


def _dense(cfg: GPTConfig, features: int, name: str, std: float):
  return nvfp4_jax.NVFP4Dense(
      features, use_bias=False, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_dtype,
      kernel_init=nn.initializers.normal(std), name=name)


def _norm(cfg: GPTConfig, name: str) -> nn.RMSNorm:
  # FP32 statistics and scale; the output is cast back to the compute dtype.
  return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=jnp.float32,
                    param_dtype=jnp.float32, name=name)


def rope_inv_freq(dim: int, base: float,
                  scaling: RopeScaling | None = None) -> jax.Array:
  """The rotary inverse frequencies `[dim / 2]` (FP32) of heads `dim` wide.

  Without `scaling`: `base^(-2i/dim)`, in the computation that calls it
  (as `rotary` always computed it). With Llama 3's `scaling`: transformers'
  `_compute_llama3_parameters`, operation for operation in FP32 on the host
  (`1 / base^(2i/dim)`, then the low frequencies divided by `factor` and
  the middle band interpolated).
  """
  if scaling is None:
    return base ** (-jnp.arange(dim // 2, dtype=jnp.float32) * 2.0 / dim)
  f32 = np.float32
  exps = np.arange(0, dim, 2).astype(f32) / f32(dim)
  # torch raises a Python float base to an FP32 tensor as the FP32 rounding
  # of the power in double precision.
  inv_freq = f32(1.0) / np.power(np.float64(base), exps.astype(np.float64)
                                 ).astype(f32)
  factor = f32(scaling.factor)
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  old = scaling.original_max_position_embeddings
  low_wavelen, high_wavelen = f32(old / low), f32(old / high)
  # torch divides a Python number by a tensor as `reciprocal() * number`.
  wavelen = (f32(1) / inv_freq) * f32(2 * math.pi)
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
  smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return jnp.asarray(np.where(medium, smoothed, scaled).astype(f32))


def rotary(x: jax.Array, base: float,
           scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary position embedding of `x: [batch, seq, heads, head_dim]` in FP32.

  Rotates the pairs `(x[..., i], x[..., i + head_dim/2])` by angle
  `pos * inv_freq[i]` (`rope_inv_freq`: `base^(-2i/head_dim)`, or Llama 3's
  scaled frequencies).
  """
  *_, seq, _, dim = x.shape
  half = dim // 2
  inv_freq = rope_inv_freq(dim, base, scaling)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  cos = jnp.cos(angles)[:, None, :]
  sin = jnp.sin(angles)[:, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# Vocabularies up to this size sum 16-bit embedding gradients as a one-hot
# GEMM (tokens x vocab x d_model x 2 FLOPs: 69 GFLOP at 32k tokens, 2048 x
# 512, ~0.1 ms on bf16 tensor cores); larger ones as an FP32 scatter-add.
ONE_HOT_VOCAB = 2048


@jax.custom_vjp
def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]`, whose table gradient is summed in FP32.

  Autodiff of `jnp.take` scatter-adds the output cotangents into a table of
  the table's dtype: with a bf16 table that sums the ~tokens/vocab rows of
  each token id in bf16 (and, on a GPU, with contended atomics into a few
  hundred rows for a byte vocabulary). Here the sum runs in FP32 and is
  rounded to the table's dtype once: for 16-bit cotangents a one-hot GEMM
  (exact products, FP32 accumulation) up to `ONE_HOT_VOCAB` ids, otherwise
  an FP32 scatter-add (`segment_sum`; for FP32 cotangents that is what
  `jnp.take`'s gradient computes).
  """
  return jnp.take(table, ids, axis=0)


def _embed_fwd(table, ids):
  # A zero-size array carries the table's row count and dtype.
  return jnp.take(table, ids, axis=0), (ids, jnp.zeros((table.shape[0], 0),
                                                       table.dtype))


def _embed_bwd(res, g):
  ids, like = res
  vocab, dtype = like.shape[0], like.dtype
  ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
  if jnp.dtype(g.dtype).itemsize == 2 and vocab <= ONE_HOT_VOCAB:
    # Out-of-range ids give zero rows, as the scatter drops them.
    onehot = jax.nn.one_hot(ids, vocab, dtype=g.dtype)
    dt = jax.lax.dot_general(onehot, g, (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
  else:
    dt = jax.ops.segment_sum(g.astype(jnp.float32), ids, vocab)
  return dt.astype(dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


class Embed(nn.Embed):
  """`nn.Embed` with its table gradient summed in FP32 (`embed_lookup`)."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (embedding,) = self.promote_dtype(self._table(), dtype=self.dtype,
                                      inexact=False)
    return embed_lookup(embedding, inputs)

  def _table(self) -> jax.Array:
    rules = nvfp4_jax.sharding.current_rules()
    if rules is None:
      return self.embedding
    # The table whole on every device (it is small): the gradient is then
    # each device's full table summed with a reduce-scatter, not a gather
    # of the whole batch's output gradient (MeshRules.gathered).
    return rules.gathered("/".join(self.scope.path + ("embedding",)),
                          self.embedding)

  def logits(self, x: jax.Array) -> jax.Array:
    """Tied output head: `x @ embedding.T` (`[..., d] -> [..., vocab]`),
    operands and accumulation in FP32 (high precision, as the untied
    head)."""
    table = self._table().astype(jnp.float32)
    return jax.lax.dot_general(x.astype(jnp.float32), table,
                               (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def fused_attention_implementation(q: jax.Array) -> str:
  """The `jax.nn.dot_product_attention` backend for `q` `[b, t, heads, d]`:
  "cudnn" (flash attention) on a GPU for 16-bit inputs with a head dimension
  cuDNN takes (a multiple of 8, at most 128), else "xla".

  `implementation=None` means XLA in JAX today, which materializes the
  `[b, heads, t, t]` scores; on the H100 it took 10 of the 40 ms of a GPT
  small step (`benchmarks.profile_step`).
  """
  d = q.shape[-1]
  if (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
      and d % 8 == 0 and d <= 128):
    return "cudnn"
  return "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     dtype) -> jax.Array:
  """Softmax attention with a causal mask, `[batch, seq, heads, head_dim]`.

  Both batched GEMMs take `dtype` operands with FP32 accumulation; the mask
  and the softmax are FP32 (high precision per the recipe, never quantized).
  """
  scale = 1.0 / math.sqrt(q.shape[-1])
  scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(dtype), k.astype(dtype),
                      preferred_element_type=jnp.float32) * scale
  seq = q.shape[1]
  mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v.astype(dtype),
                    preferred_element_type=jnp.float32)


def _split_over_model(x: jax.Array, axis: int, layer: tuple) -> jax.Array:
  """`x` (a view of the column-parallel layer `layer`'s output) split over
  the `model` mesh axis along `axis`, as the layer's contiguous column
  split already places it (a sharding constraint: XLA's propagation
  through the reshape could pick another split); `x` itself without
  `mesh_rules` or a `model` axis of more than one device, where the layer
  is not column-parallel, where the axis does not divide `x.shape[axis]`,
  and under sharding in types."""
  rules = nvfp4_jax.sharding.current_rules()
  if (rules is None or rules.model is None
      or rules.sizes[rules.model] == 1
      or rules.style("/".join(layer)) != "column"
      or x.shape[axis] % rules.sizes[rules.model]):
    return x
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if (mesh is not None and not mesh.empty
      and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)):
    return x
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[axis] = rules.model
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(rules.mesh, P(*spec)))


def _check_model_split(cfg: GPTConfig, layer: tuple) -> None:
  """Raises where the `model` mesh axis splits `attn/qkv` (column-parallel)
  into parts that are not whole key/value heads."""
  rules = nvfp4_jax.sharding.current_rules()
  if (rules is None or rules.model is None
      or rules.style("/".join(layer)) != "column"):
    return
  n = rules.sizes[rules.model]
  if cfg.kv_heads % n:
    raise ValueError(
        f"the model mesh axis ({rules.model}={n}) splits "
        f"{'/'.join(layer)!r} by columns, but kv_heads={cfg.kv_heads} "
        f"(GPTConfig.num_kv_heads, or num_heads) is not a multiple of it: "
        f"each device must hold whole key/value heads with their query "
        f"groups; use a model axis that divides {cfg.kv_heads}.")


class Attention(nn.Module):
  """Causal self-attention: `qkv` and `out` projections in NVFP4Dense."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, t, _ = x.shape
    std = 0.02
    h, kv, hd = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    layer = self.scope.path + ("qkv",)
    _check_model_split(cfg, layer)
    qkv = _dense(cfg, cfg.qkv_width, "qkv", std)(x)
    if cfg.fused_layout == "interleaved":
      # `[kv_heads, (q_0 .. q_{g-1}, k, v), head_dim]`: a device's columns
      # are whole query groups with their key and value heads.
      g = h // kv
      qkv = _split_over_model(qkv.reshape(b, t, kv, g + 2, hd), 2, layer)
      q = qkv[:, :, :, :g].reshape(b, t, h, hd)
      k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    else:
      q, k, v = jnp.split(qkv.reshape(b, t, h + 2 * kv, hd), [h, h + kv],
                          axis=2)
    q = rotary(q, cfg.rope_base, cfg.rope_scaling)
    k = rotary(k, cfg.rope_base, cfg.rope_scaling)
    if cfg.attention == "fused":
      dt = cfg.jnp_dtype
      q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
      impl = fused_attention_implementation(q)
      try:
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=impl)
      except (NotImplementedError, RuntimeError):
        # cuDNN refuses at trace time where it is missing or the GPU or the
        # shapes are unsupported (e.g. compute capability < 8); XLA always
        # works.
        if impl != "cudnn":
          raise
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation="xla")
    else:
      # Query head `i` reads key/value head `i // g` (jax.nn's fused
      # attention does this itself).
      y = causal_attention(q, jnp.repeat(k, h // kv, axis=2),
                           jnp.repeat(v, h // kv, axis=2), cfg.jnp_dtype)
    y = y.astype(cfg.jnp_dtype)
    out_std = std / math.sqrt(2 * cfg.num_layers)
    return _dense(cfg, cfg.d_model, "out", out_std)(y.reshape(b, t, -1))


def _gate_up_view(h: jax.Array, block: int | None) -> jax.Array:
  """`h: [..., 2F]` viewed as `[..., F / block, 2, block]` (gate, up)."""
  *lead, width = h.shape
  f = width // 2
  block = f if block is None else block
  if width % 2 or f % block:
    raise ValueError(
        f"swiglu: the last dimension {width} must be 2 * F with F a multiple "
        f"of block={block}; give h = [gate, up] of equal widths.")
  return h.reshape(*lead, f // block, 2, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def swiglu(h: jax.Array, block: int | None = None) -> jax.Array:
  """`silu(gate) * up` of `h` (`[..., 2F] -> [..., F]`), in FP32.

  `block=None`: `h = [gate, up]` (two halves). `block=B`: gate and up
  alternate in blocks of `B` columns, `[..., F / B, (gate, up), B]` (the
  GPT's "interleaved" layout, `GATE_UP_BLOCK`); the result's feature `f`
  is then gate column `f` of that order with its up column, so a
  contiguous split of `h`'s columns gives a contiguous split of the
  result's features.

  The result has `h`'s dtype. The same values as autodiff of the plain
  expression (the same FP32 operations in the same order), with a leaner
  backward: it keeps only `h` (autodiff keeps FP32 intermediates of the
  sigmoid as well) and writes `dh` in one elementwise pass over `h` and the
  cotangent. Autodiff's backward (and a custom one that concatenates the two
  halves) compiled to four passes over `[..., 2F]` in GPT base on the H100:
  each half written, then copied into the concatenate once for each of its
  two consumer GEMMs (BENCHMARKS.md, 2026-11-25 night).
  """
  return _swiglu_fwd(h, block)[0]


def _swiglu_fwd(h, block):
  hp = _gate_up_view(h.astype(jnp.float32), block)
  gate, up = hp[..., 0, :], hp[..., 1, :]
  y = (jax.nn.silu(gate) * up).astype(h.dtype)
  return y.reshape(*h.shape[:-1], h.shape[-1] // 2), h


def _swiglu_bwd(block, h, g):
  # `h` viewed as `[..., G, 2, B]` (gate, up): both halves of `dh` come from
  # one select over the `2` axis, so `dh` is a single elementwise expression.
  # (With a concatenate of the halves, XLA computed each half in its own
  # fusion and then copied both into the concatenate.)
  hp = _gate_up_view(h, block).astype(jnp.float32)
  gate, up = hp[..., :1, :], hp[..., 1:, :]
  gf = g.astype(jnp.float32).reshape(*hp.shape[:-2], hp.shape[-1])[
      ..., None, :]
  s = jax.nn.sigmoid(gate)
  gu = gf * up
  # Autodiff's operations, in its order: d silu(x) = s + x * (s * (1 - s)).
  d_gate = gu * s + (gate * gu) * (s * (1.0 - s))
  d_up = (gate * s) * gf
  first = jax.lax.broadcasted_iota(jnp.int32, (2, 1), 0) == 0
  dh = jnp.where(first, d_gate, d_up)  # [..., G, 2, B]
  return (dh.reshape(h.shape).astype(h.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class FeedForward(nn.Module):
  """SwiGLU or squared-ReLU MLP: `up` and `down` projections in NVFP4Dense."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    width = 2 * cfg.d_ff if cfg.mlp == "swiglu" else cfg.d_ff
    h = _dense(cfg, width, "up", 0.02)(x)
    if cfg.mlp == "swiglu":
      h = swiglu(h, GATE_UP_BLOCK if cfg.fused_layout == "interleaved"
                 else None)
    else:
      h = jnp.square(jax.nn.relu(h.astype(jnp.float32)))
    out_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    return _dense(cfg, cfg.d_model, "down", out_std)(h.astype(cfg.jnp_dtype))


def _token_split(x: jax.Array) -> jax.Array:
  """The residual stream `x: [batch, seq, d_model]` as `mesh_rules` split
  activations between layers (`MeshRules.token_split`: under sequence
  parallelism, over the batch axes and `model`); `x` itself otherwise."""
  rules = nvfp4_jax.sharding.current_rules()
  return x if rules is None else rules.token_split(x)


class Block(nn.Module):
  """One pre-norm transformer block."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.cfg.jnp_dtype
    x = _token_split(x)
    x = x + Attention(self.cfg, name="attn")(
        _norm(self.cfg, "attn_norm")(x).astype(dt))
    h = _norm(self.cfg, "mlp_norm")(x).astype(dt)
    if self.cfg.num_experts:
      cfg = self.cfg
      moe = NVFP4MoE(num_experts=cfg.num_experts, hidden=cfg.d_ff,
                     top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                     kernel_init=nn.initializers.normal(0.02),
                     param_dtype=dt, dtype=dt, name="moe")
      return x + moe(h)
    return x + FeedForward(self.cfg, name="mlp")(h)


class GPT(nn.Module):
  """Decoder-only language model.

  `__call__(tokens: int [batch, seq]) -> logits: float32 [batch, seq, vocab]`.
  For NVFP4 GEMMs, `batch * seq` (the Wgrad contraction) must be a multiple
  of 32. Apply it inside `nvfp4_jax.precision_rules(...)` with an "nvfp4" RNG
  stream (stochastic rounding keys); `paper_rules(cfg.num_layers)` is the
  paper's preset.
  """

  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype,
                  param_dtype=cfg.jnp_dtype,
                  embedding_init=nn.initializers.normal(1.0), name="embed")
    x = embed(tokens)
    x = _token_split(x)
    block = Block
    if cfg.remat == "quantized":
      block = nn.remat(Block, policy=nvfp4_jax.remat_policy())
    elif cfg.remat == "full":
      block = nn.remat(Block, policy=jax.checkpoint_policies.nothing_saveable)
    for i in range(cfg.num_layers):
      x = block(cfg, name=f"block_{i}")(x)
    x = _norm(cfg, "final_norm")(x)
    if cfg.tie_embeddings:
      return embed.logits(x)
    # The untied output head: high precision (plain nn.Dense), FP32 logits.
    return nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                    param_dtype=cfg.jnp_dtype,
                    kernel_init=nn.initializers.normal(0.02), name="head")(x)


# The layout of a saved model configuration without a `fused_layout` field:
# the only one there was before the field existed.
LEGACY_FUSED_LAYOUT = "concatenated"


def saved_fused_layout(model_config: dict) -> str:
  """The fused layout a saved `GPTConfig` (as a dict: `dataclasses.asdict`,
  a run's `config.json` "model") describes; `LEGACY_FUSED_LAYOUT` where it
  predates the field."""
  layout = model_config.get("fused_layout", LEGACY_FUSED_LAYOUT)
  check_choice("saved fused_layout", layout, FUSED_LAYOUTS)
  return layout


def _fused_order(cfg: GPTConfig, layer: str, layout: str) -> np.ndarray:
  """The fused kernel `layer`'s ("qkv" or "up") columns under `layout`, each
  named by its column under "concatenated"."""
  if layer == "qkv":
    h, kv, hd = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    cols = np.arange(cfg.qkv_width)
    if layout == "concatenated":
      return cols
    g = h // kv
    q = cols[:h * hd].reshape(kv, g, hd)
    k = cols[h * hd:(h + kv) * hd].reshape(kv, 1, hd)
    v = cols[(h + kv) * hd:].reshape(kv, 1, hd)
    # -> [kv_heads, (q_0 .. q_{g-1}, k, v), head_dim]
    return np.concatenate([q, k, v], axis=1).reshape(-1)
  cols = np.arange(2 * cfg.d_ff).reshape(2, cfg.d_ff // GATE_UP_BLOCK,
                                         GATE_UP_BLOCK)
  if layout == "concatenated":
    return cols.reshape(-1)
  return cols.transpose(1, 0, 2).reshape(-1)  # -> [d_ff / 16, (gate, up), 16]


def fused_permutation(cfg: GPTConfig, layer: str, src: str,
                      dst: str) -> np.ndarray:
  """Column indices `perm`: a kernel of fused layer `layer` ("qkv" or "up")
  stored under layout `src` is `kernel[..., perm]` under `dst`
  (`GPTConfig.fused_layout`). Whole 16-column blocks move together when
  `head_dim` is a multiple of 16 ("up" always), so every NVFP4 16x16 tile
  of the kernel keeps its contents."""
  for name, layout in (("src", src), ("dst", dst)):
    check_choice(f"fused_layout ({name})", layout, FUSED_LAYOUTS)
  check_choice("fused layer", layer, ("qkv", "up"))
  to_src = _fused_order(cfg, layer, src)
  inverse = np.empty_like(to_src)
  inverse[to_src] = np.arange(to_src.size)
  # Column j of `dst` holds concatenated column _fused_order(dst)[j], which
  # `src` keeps at inverse[that].
  return inverse[_fused_order(cfg, layer, dst)]


def convert_fused_layout(tree: Any, cfg: GPTConfig, src: str,
                         dst: str) -> Any:
  """`tree` (GPT parameters, or any pytree holding copies of them: a train
  state's FP32 master weights and optimizer moments) with every fused
  kernel's columns permuted from layout `src` to `dst`.

  A leaf is converted when its path ends with `attn/qkv/kernel` (last
  dimension `cfg.qkv_width`) or, for SwiGLU, `mlp/up/kernel` (`2 * d_ff`);
  other leaves are returned as they are. A converted array keeps its
  sharding. Converting a "concatenated" tree to "interleaved" and back
  gives it back bit for bit.
  """
  if src == dst:
    for name, layout in (("src", src), ("dst", dst)):
      check_choice(f"fused_layout ({name})", layout, FUSED_LAYOUTS)
    return tree
  perms = {("attn", "qkv", "kernel"): (cfg.qkv_width,
                                       fused_permutation(cfg, "qkv", src,
                                                         dst))}
  if cfg.mlp == "swiglu" and not cfg.num_experts:
    perms[("mlp", "up", "kernel")] = (2 * cfg.d_ff, fused_permutation(
        cfg, "up", src, dst))

  def key(k):
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

  def convert(kp, x):
    keys = tuple(key(k) for k in kp)[-3:]
    hit = perms.get(keys)
    if hit is None or np.ndim(x) < 1 or np.shape(x)[-1] != hit[0]:
      return x
    perm = hit[1]
    if isinstance(x, jax.Array):
      # Compiled with the array's own sharding as the result's (every
      # process runs it alike where the array spans several).
      return jax.jit(lambda a: jnp.take(a, perm, axis=-1),
                     out_shardings=x.sharding)(x)
    return np.take(np.asarray(x), perm, axis=-1)
  return jax.tree_util.tree_map_with_path(convert, tree)
