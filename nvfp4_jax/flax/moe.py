"""Mixture-of-experts layers whose expert GEMMs follow the NVFP4 recipe.

`NVFP4MoE` (linen) and `NNXMoE` (NNX): a top-k router in FP32 (never
quantized), dispatch by sorting the token copies by expert, SwiGLU experts
run as grouped GEMMs (`nvfp4_jax.ragged_dot`), and the weighted combine.

    router      logits = x @ router (FP32), top-k, weights = softmax of the
                top-k logits; load-balancing loss (Switch Transformer):
                E * sum_e f_e * P_e, f_e the fraction of token copies routed
                to e, P_e the mean router probability of e.
    dispatch    the T*k token copies sorted by expert (stable): group sizes
                per expert; with `capacity_factor`, each expert keeps its
                first C = ceil(cf * T * k / E) copies in token order and the
                rest are dropped (zero output); without, nothing is dropped.
    experts     h = silu(xs @ up[e][:, :H]) * (xs @ up[e][:, H:]),
                out = h @ down[e]: two grouped GEMMs, "experts/up" (gate
                and up fused, [E, D, 2H]) and "experts/down" ([E, H, D]).
    combine     y[t] = sum_j weight[t, j] * out[copy (t, j)].

The permutations are gathers with a custom VJP: the transpose of gathering
by a permutation is gathering by its inverse (no scatter-add).

Precision rules address the expert GEMMs by path like any layer
(".../moe/experts/up", ".../moe/experts/down"), so the paper's selective
BF16 applies, and the late switch. `nvfp4_jax.report` lists them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import as_recipe
from nvfp4_jax.flax.linen import RNG_STREAM
from nvfp4_jax.flax.linen import _linen_key
from nvfp4_jax.flax.linen import _linen_path
from nvfp4_jax.flax.linen import layer_call
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.training.ragged_dot import ragged_dot

AUX_LOSS = "moe_aux_loss"


# ----------------------------------------------------------------------------
# Routing and dispatch (pure functions; the layers and the expert-parallel
# form share them).
# ----------------------------------------------------------------------------


@jax.custom_vjp
def permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """`x[order]` for a permutation `order` of `x`'s rows, `inverse` its
  inverse; the gradient is the gather `g[inverse]`."""
  return jnp.take(x, order, axis=0)


def _permute_fwd(x, order, inverse):
  return permute(x, order, inverse), (order, inverse)


def _permute_bwd(res, g):
  order, inverse = res
  return jnp.take(g, inverse, axis=0), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@dataclasses.dataclass(frozen=True)
class Routing:
  """Where each token copy goes.

  Attributes:
    order: int32 `[T * k]`, the copies (index `t * k + j`) sorted by expert,
      kept copies first (dropped ones, under a capacity, after all groups).
    inverse: the inverse permutation.
    group_sizes: int32 `[E]`, kept copies per expert.
    weights: FP32 `[T, k]`, the combine weights.
    experts: int32 `[T, k]`, each copy's expert.
    aux_loss: FP32 scalar, the load-balancing loss.
  """

  order: jax.Array
  inverse: jax.Array
  group_sizes: jax.Array
  weights: jax.Array
  experts: jax.Array
  aux_loss: jax.Array


jax.tree_util.register_dataclass(
    Routing, data_fields=["order", "inverse", "group_sizes", "weights",
                          "experts", "aux_loss"], meta_fields=[])


def capacity(tokens: int, num_experts: int, top_k: int,
             capacity_factor: float | None) -> int | None:
  """Copies an expert keeps: `ceil(cf * T * k / E)`, or None (dropless)."""
  if capacity_factor is None:
    return None
  return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def route(logits: jax.Array, top_k: int,
          capacity_factor: float | None = None) -> Routing:
  """Top-k routing of FP32 `logits [T, E]` and the sort that dispatches it."""
  t, num_experts = logits.shape
  logits = logits.astype(jnp.float32)
  top_logits, experts = jax.lax.top_k(logits, top_k)
  weights = jax.nn.softmax(top_logits, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  flat = experts.reshape(-1)
  counts = jnp.bincount(flat, length=num_experts)
  fraction = counts.astype(jnp.float32) / (t * top_k)
  aux = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = counts.astype(jnp.int32)
  cap = capacity(t, num_experts, top_k, capacity_factor)
  if cap is not None:
    sorted_experts = flat[order]
    start = jnp.cumsum(counts) - counts
    rank = jnp.arange(t * top_k, dtype=jnp.int32) - start[sorted_experts]
    kept = rank < cap
    # Kept copies stay grouped by expert; dropped ones move past the groups.
    order = order[jnp.argsort(jnp.where(kept, sorted_experts, num_experts),
                              stable=True)]
    group_sizes = jnp.minimum(group_sizes, cap)
  inverse = jnp.argsort(order).astype(jnp.int32)
  return Routing(order=order, inverse=inverse, group_sizes=group_sizes,
                 weights=weights, experts=experts.astype(jnp.int32),
                 aux_loss=aux)


def dispatch(x: jax.Array, routing: Routing, top_k: int) -> jax.Array:
  """The token copies `[T * k, D]` in expert order (`x [T, D]`)."""
  copies = jnp.repeat(x, top_k, axis=0)
  return permute(copies, routing.order, routing.inverse)


def combine(out: jax.Array, routing: Routing, top_k: int) -> jax.Array:
  """`y [T, D]` from the experts' outputs in expert order."""
  copies = permute(out, routing.inverse, routing.order)
  t = copies.shape[0] // top_k
  copies = copies.reshape(t, top_k, -1)
  return jnp.einsum("tkd,tk->td", copies,
                    routing.weights.astype(copies.dtype))


def swiglu_experts(xs: jax.Array, group_sizes: jax.Array, gemm) -> jax.Array:
  """SwiGLU experts on sorted copies: `gemm(x, group_sizes, name)` runs each
  grouped GEMM ("up": gate and up fused, `[.., 2H]`; "down")."""
  h = gemm(xs, group_sizes, "up")
  gate, lin = jnp.split(h, 2, axis=-1)
  return gemm(jax.nn.silu(gate) * lin, group_sizes, "down")


# ----------------------------------------------------------------------------
# Linen.
# ----------------------------------------------------------------------------


def expert_gemm(x, w, group_sizes, *, path: str, recipe, key, rules=None,
                dtype=None, precision=None, align: str = "pad"):
  """The grouped GEMM of the expert projection at `path`, under the rules in
  scope (`layer_call`: recipe by path, key, late switch)."""
  dtype = dtype or x.dtype

  def run(r: Recipe, k):
    a, b = x, w
    if not r.quantized:
      a, b = x.astype(dtype), w.astype(dtype)
    return ragged_dot(a, b, group_sizes, precision, dtype, recipe=r, key=k,
                      align=align, name=path)
  return layer_call(run, recipe=recipe, path=path, key=key, rules=rules)


class _Experts(nn.Module):
  """One stacked expert projection: its kernel `[E, in, out]`."""

  num_experts: int
  features: int
  kernel_init: Any
  param_dtype: Any
  recipe: Recipe | str | None
  precision: Any = None

  @nn.compact
  def __call__(self, x, group_sizes):
    kernel = self.param("kernel", self.kernel_init,
                        (self.num_experts, x.shape[-1], self.features),
                        self.param_dtype)
    return expert_gemm(x, kernel, group_sizes, path=_linen_path(self),
                       recipe=self.recipe, key=_linen_key(self),
                       precision=self.precision)


def _expert_init(base):
  """A per-expert initializer: `base` on each `[in, out]` kernel."""
  def init(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, shape[0])
    return jax.vmap(lambda k: base(k, shape[1:], dtype))(keys)
  return init


class NVFP4MoE(nn.Module):
  """A mixture of SwiGLU experts whose expert GEMMs follow the recipe.

  Call it on `x [..., D]`; it returns `[..., D]` and sows the
  load-balancing loss into the "losses" collection under `AUX_LOSS`
  (`model.apply(..., mutable=["losses"])`; add `aux_loss_weight` times it
  to the training loss).

  Attributes:
    num_experts: E.
    hidden: each expert's hidden width H.
    top_k: experts per token.
    capacity_factor: None (dropless: every copy is computed) or the
      capacity factor (each expert keeps `ceil(cf * T * k / E)` copies).
    recipe: the expert GEMMs' recipe, or None for the rules' by path
      (".../experts/up", ".../experts/down").
    kernel_init: each expert's `[in, out]` initializer.
    router_init: the FP32 router's `[D, E]` initializer.
    param_dtype: of the expert kernels (FP32 master weights).
    dtype: the computation dtype of activations (None: the input's).
    precision: of high-precision expert GEMMs.
  """

  num_experts: int
  hidden: int
  top_k: int = 2
  capacity_factor: float | None = None
  recipe: Recipe | str | None = None
  kernel_init: Any = nn.initializers.lecun_normal()
  router_init: Any = nn.initializers.normal(0.02)
  param_dtype: Any = jnp.float32
  dtype: Any = None
  precision: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    check_moe(self.num_experts, self.top_k, self.capacity_factor,
              _linen_path(self))
    shape = x.shape
    d = shape[-1]
    x = x.reshape(-1, d)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    router = self.param("router", self.router_init, (d, self.num_experts),
                        jnp.float32)
    logits = jnp.dot(x.astype(jnp.float32), router,
                     precision=jax.lax.Precision.HIGHEST)
    routing = route(logits, self.top_k, self.capacity_factor)
    self.sow("losses", AUX_LOSS, routing.aux_loss)
    experts = _SwiGLUExperts(self.num_experts, self.hidden,
                             _expert_init(self.kernel_init),
                             self.param_dtype, self.recipe, self.precision,
                             name="experts")
    out = experts(dispatch(x, routing, self.top_k), routing.group_sizes)
    return combine(out, routing, self.top_k).reshape(shape)


class _SwiGLUExperts(nn.Module):
  """The "experts" scope: the projections "up" (`[E, D, 2H]`, gate and up
  fused) and "down" (`[E, H, D]`)."""

  num_experts: int
  hidden: int
  kernel_init: Any
  param_dtype: Any
  recipe: Recipe | str | None
  precision: Any = None

  @nn.compact
  def __call__(self, xs, group_sizes):
    def make(name, features):
      return _Experts(self.num_experts, features, self.kernel_init,
                      self.param_dtype, self.recipe, self.precision,
                      name=name)
    proj = {"up": make("up", 2 * self.hidden), "down": make("down",
                                                            xs.shape[-1])}
    return swiglu_experts(xs, group_sizes,
                          lambda x, gs, which: proj[which](x, gs))


def check_moe(num_experts: int, top_k: int, capacity_factor, path: str
              ) -> None:
  """A clear error for a configuration the MoE layer cannot run."""
  where = f"MoE layer {path or '<root>'!r}: "
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"{where}num_experts must be a positive int, got "
                     f"{num_experts!r}.")
  if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
    raise ValueError(f"{where}top_k must be an int in [1, num_experts="
                     f"{num_experts}], got {top_k!r}.")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"{where}capacity_factor must be positive or None "
                     f"(dropless), got {capacity_factor!r}.")


# ----------------------------------------------------------------------------
# NNX.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class NNXExpertGemm:
  """The grouped GEMM of an NNX expert projection: a static value, like
  `NNXDotGeneral` (path and rules set by `apply_rules`/`inject_nnx`)."""

  path: str | None = None
  recipe: Recipe | None = None
  rules: PrecisionRules | None = None

  def __post_init__(self):
    object.__setattr__(self, "recipe",
                       as_recipe(self.recipe, f"{type(self).__name__}: "))

  def __call__(self, x, w, group_sizes, *, key=None, precision=None):
    return expert_gemm(x, w, group_sizes, path=self.path or "", key=key,
                       recipe=self.recipe, rules=self.rules,
                       precision=precision)


class NNXMoE(nnx.Module):
  """`NVFP4MoE` for flax NNX: the same routing, experts and loss.

  State: `router` `[D, E]` (FP32), `up` `[E, D, 2H]`, `down` `[E, H, D]`
  (`nnx.Param`s). `__call__(x)` returns `y`; the last call's load-balancing
  loss is `self.aux_loss` (an `nnx.Intermediate`). Keys for stochastic
  rounding come from an "nvfp4" RNG stream if `rngs` has one, else from the
  step of `precision_rules` and the paths `apply_rules` sets
  (".../experts/up", ".../experts/down").
  """

  def __init__(self, features: int, num_experts: int, hidden: int, *,
               top_k: int = 2, capacity_factor: float | None = None,
               recipe: Recipe | str | None = None,
               kernel_init=nn.initializers.lecun_normal(),
               router_init=nn.initializers.normal(0.02),
               param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs):
    check_moe(num_experts, top_k, capacity_factor, "NNXMoE")
    self.num_experts, self.top_k = num_experts, top_k
    self.capacity_factor = capacity_factor
    self.precision = precision
    init = _expert_init(kernel_init)
    self.router = nnx.Param(router_init(rngs.params(),
                                        (features, num_experts),
                                        jnp.float32))
    self.up = nnx.Param(init(rngs.params(), (num_experts, features,
                                             2 * hidden), param_dtype))
    self.down = nnx.Param(init(rngs.params(), (num_experts, hidden,
                                               features), param_dtype))
    recipe = as_recipe(recipe, "NNXMoE: ")
    self.up_gemm = NNXExpertGemm(recipe=recipe)
    self.down_gemm = NNXExpertGemm(recipe=recipe)
    if RNG_STREAM in rngs:
      self.sr_rngs = rngs[RNG_STREAM].fork()
    self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = jnp.dot(x.astype(jnp.float32), self.router[...],
                     precision=jax.lax.Precision.HIGHEST)
    routing = route(logits, self.top_k, self.capacity_factor)
    self.aux_loss.value = routing.aux_loss
    gemms = {"up": (self.up_gemm, self.up[...]),
             "down": (self.down_gemm, self.down[...])}

    def gemm(a, gs, which):
      op, w = gemms[which]
      key = self.sr_rngs() if hasattr(self, "sr_rngs") else None
      return op(a, w, gs, key=key, precision=self.precision)
    out = swiglu_experts(dispatch(x, routing, self.top_k),
                         routing.group_sizes, gemm)
    return combine(out, routing, self.top_k).reshape(shape)
