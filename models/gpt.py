"""A GPT-style decoder whose every projection is an `NVFP4Dense`.

Layout per block (pre-norm, no biases anywhere):

    x = x + attn/out( causal_attention( rotary( attn/qkv( RMSNorm(x) ) ) ) )
    x = x + mlp/down( act( mlp/up( RMSNorm(x) ) ) )

Precision follows NVFP4_SPEC section 5. The four projections of each block
(`block_{i}/attn/qkv`, `block_{i}/attn/out`, `block_{i}/mlp/up`,
`block_{i}/mlp/down`) are `NVFP4Dense` layers without a fixed recipe: each
takes its recipe from the active `nvfp4_jax.PrecisionRules` by that path, so
`paper_rules(num_layers)` keeps the first two and the last ~15% of blocks in
BF16. Everything else is high precision by construction: the token embedding
(an `nn.Embed` whose gradient is summed in FP32: `embed_lookup`), the
untied output head (`nn.Dense`), RMSNorm, rotary embeddings, the attention
score and value batched GEMMs (FP32 accumulation) and the softmax run in
FP32, the MLP non-linearity in FP32.

The SwiGLU MLP fuses its gate and up projections into one `mlp/up` GEMM of
width `2 * d_ff` (one quantization of the shared input instead of two).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

import nvfp4_jax
from nvfp4_jax.flax.moe import NVFP4MoE
from nvfp4_jax.core.recipe import check_field

MLP_KINDS = ("swiglu", "relu2")
ATTENTION_KINDS = ("fused", "reference")
REMAT_KINDS = ("none", "quantized")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_choice(name: str, value, choices) -> None:
  """Raises a ValueError naming `name`, its `value` and the `choices`."""
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; use one of {tuple(choices)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
  """Shape and numerics of the decoder.

  Attributes:
    vocab_size: token ids `[0, vocab_size)`; 256 for bytes.
    d_model: residual width, a multiple of 32 (the MX block) so every
      projection can be quantized.
    num_layers: number of blocks, named `block_0 ... block_{n-1}`.
    num_heads: attention heads; `d_model / num_heads` must be even (rotary).
    d_ff: MLP hidden width, a multiple of 32.
    mlp: "swiglu" (`silu(gate) * up`) or "relu2" (squared ReLU, as in the
      paper's Nemotron models).
    rope_base: rotary frequency base.
    dtype: compute dtype of activations and parameters, "float32" or
      "bfloat16" (the optimizer keeps FP32 master weights either way).
    norm_eps: RMSNorm epsilon.
    attention: "fused" (`jax.nn.dot_product_attention`: cuDNN flash attention
      on GPU for bf16/fp16 activations, XLA elsewhere; see
      `fused_attention_implementation`) or "reference" (`causal_attention`:
      explicit FP32 scores; slower, materializes `[batch, heads, seq,
      seq]`).
    remat: "none" (autodiff saves what it needs) or "quantized": each block
      is rematerialized and saves only the quantized residuals of its NVFP4
      layers (`nvfp4_jax.remat_policy`), recomputing the rest in the
      backward pass. Layers kept in high precision save nothing.
    num_experts: 0 for the dense MLP; else every block's MLP is a mixture
      of `num_experts` SwiGLU experts of hidden width `d_ff`
      (`nvfp4_jax.flax.moe.NVFP4MoE`, named `block_{i}/moe`, its expert
      GEMMs `block_{i}/moe/experts/up` and `.../down`).
    top_k: experts per token (MoE).
    capacity_factor: None (dropless) or each expert's capacity factor.
    aux_loss_weight: the load-balancing loss's weight in the training loss
      (the mean over MoE blocks).
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

  def __post_init__(self):
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
                          ("remat", REMAT_KINDS), ("dtype", tuple(_DTYPES))):
      check_field("GPTConfig", name, getattr(self, name), "str",
                  example=choices[0])
      check_choice(name, getattr(self, name), choices)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

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


def rotary(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of `x: [batch, seq, heads, head_dim]` in FP32.

  Rotates the pairs `(x[..., i], x[..., i + head_dim/2])` by angle
  `pos * base^(-2i/head_dim)`.
  """
  *_, seq, _, dim = x.shape
  half = dim // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dim)
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
    (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype,
                                      inexact=False)
    rules = nvfp4_jax.sharding.current_rules()
    if rules is not None:
      # The table whole on every device (it is small): the gradient is then
      # each device's full table summed with a reduce-scatter, not a
      # gather of the whole batch's output gradient (MeshRules.gathered).
      embedding = rules.gathered("/".join(self.scope.path + ("embedding",)),
                                 embedding)
    return embed_lookup(embedding, inputs)


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


class Attention(nn.Module):
  """Causal self-attention: `qkv` and `out` projections in NVFP4Dense."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, t, _ = x.shape
    std = 0.02
    qkv = _dense(cfg, 3 * cfg.d_model, "qkv", std)(x)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * cfg.num_heads, cfg.head_dim), 3,
                        axis=2)
    q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
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
      y = causal_attention(q, k, v, cfg.jnp_dtype)
    y = y.astype(cfg.jnp_dtype)
    out_std = std / math.sqrt(2 * cfg.num_layers)
    return _dense(cfg, cfg.d_model, "out", out_std)(y.reshape(b, t, -1))


@jax.custom_vjp
def swiglu(h: jax.Array) -> jax.Array:
  """`silu(gate) * up` of `h = [gate, up]` (`[..., 2F] -> [..., F]`), in FP32.

  The result has `h`'s dtype. The same values as autodiff of the plain
  expression (the same FP32 operations in the same order), with a leaner
  backward: it keeps only `h` (autodiff keeps FP32 intermediates of the
  sigmoid as well) and writes `dh` in one elementwise pass over `h` and the
  cotangent. Autodiff's backward (and a custom one that concatenates the two
  halves) compiled to four passes over `[..., 2F]` in GPT base on the H100:
  each half written, then copied into the concatenate once for each of its
  two consumer GEMMs (BENCHMARKS.md, 2026-11-25 night).
  """
  return _swiglu_fwd(h)[0]


def _swiglu_fwd(h):
  gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
  return (jax.nn.silu(gate) * up).astype(h.dtype), h


def _swiglu_bwd(h, g):
  # `h` viewed as `[..., 2, F]` (gate, up): both halves of `dh` come from one
  # select over that axis, so `dh` is a single elementwise expression. (With
  # a concatenate of the halves, XLA computed each half in its own fusion and
  # then copied both into the concatenate.)
  *lead, width = h.shape
  hp = h.reshape(*lead, 2, width // 2).astype(jnp.float32)
  gate, up = hp[..., :1, :], hp[..., 1:, :]
  gf = g.astype(jnp.float32)[..., None, :]
  s = jax.nn.sigmoid(gate)
  gu = gf * up
  # Autodiff's operations, in its order: d silu(x) = s + x * (s * (1 - s)).
  d_gate = gu * s + (gate * gu) * (s * (1.0 - s))
  d_up = (gate * s) * gf
  first = jax.lax.broadcasted_iota(jnp.int32, (2, 1), 0) == 0
  dh = jnp.where(first, d_gate, d_up)  # [..., 2, F]
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
      h = swiglu(h)
    else:
      h = jnp.square(jax.nn.relu(h.astype(jnp.float32)))
    out_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    return _dense(cfg, cfg.d_model, "down", out_std)(h.astype(cfg.jnp_dtype))


class Block(nn.Module):
  """One pre-norm transformer block."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.cfg.jnp_dtype
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
    x = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype,
              param_dtype=cfg.jnp_dtype,
              embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
    block = Block
    if cfg.remat == "quantized":
      block = nn.remat(Block, policy=nvfp4_jax.remat_policy())
    for i in range(cfg.num_layers):
      x = block(cfg, name=f"block_{i}")(x)
    x = _norm(cfg, "final_norm")(x)
    # The untied output head: high precision (plain nn.Dense), FP32 logits.
    return nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                    param_dtype=cfg.jnp_dtype,
                    kernel_init=nn.initializers.normal(0.02), name="head")(x)
