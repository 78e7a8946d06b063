"""Mixture-of-experts layers whose expert GEMMs follow the NVFP4 recipe.

`NVFP4MoE` (linen) and `NNXMoE` (NNX) hold the FP32 router (never quantized)
and the stacked SwiGLU expert kernels, "experts/up" (gate and up fused,
`[E, D, 2H]`) and "experts/down" (`[E, H, D]`), and run the layer's math,
`nvfp4_jax.training.moe.moe_forward` (top-k routing and its load-balancing
loss, the sort dispatch, the experts as grouped GEMMs, the weighted
combine, expert parallelism). `ExpertGemm` is one expert projection's
grouped GEMM (`nvfp4_jax.ragged_dot`) under the precision rules.

Precision rules address the expert GEMMs by path like any layer
(".../moe/experts/up", ".../moe/experts/down"), so the paper's selective
BF16 applies, and the late switch. `nvfp4_jax.report` lists them.
"""

from __future__ import annotations

import dataclasses
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
from nvfp4_jax.flax.linen import observe_input
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.ops.ragged_quantize.api import alignment
from nvfp4_jax.training.moe import check_moe
from nvfp4_jax.training.moe import moe_forward
from nvfp4_jax.training.moe import whole
from nvfp4_jax.training.ragged_dot import ragged_dot

AUX_LOSS = "moe_aux_loss"


# ----------------------------------------------------------------------------
# Linen.
# ----------------------------------------------------------------------------


class _Experts(nn.Module):
  """One stacked expert projection: its kernel `[E, in, out]`, its path
  and its stochastic-rounding key."""

  num_experts: int
  features: int
  kernel_init: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, in_features: int):
    kernel = self.param("kernel", self.kernel_init,
                        (self.num_experts, in_features, self.features),
                        self.param_dtype)
    return kernel, _linen_path(self), _linen_key(self)


class _SwiGLUExperts(nn.Module):
  """The "experts" scope: the projections "up" (`[E, D, 2H]`, gate and up
  fused) and "down" (`[E, H, D]`)."""

  num_experts: int
  hidden: int
  kernel_init: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, d: int):
    up = _Experts(self.num_experts, 2 * self.hidden, self.kernel_init,
                  self.param_dtype, name="up")(d)
    down = _Experts(self.num_experts, d, self.kernel_init, self.param_dtype,
                    name="down")(self.hidden)
    return {"up": up, "down": down}


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
  to the training loss). Under `nvfp4_jax.mesh_rules` with an `expert`
  mesh axis it runs expert parallel
  (`nvfp4_jax.training.moe.moe_forward`).

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
    x, restore = whole(x)
    shape = x.shape
    d = shape[-1]
    x = x.reshape(-1, d)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    router = self.param("router", self.router_init, (d, self.num_experts),
                        jnp.float32)
    proj = _SwiGLUExperts(self.num_experts, self.hidden,
                          _expert_init(self.kernel_init), self.param_dtype,
                          name="experts")(d)
    gemms = {name: ExpertGemm(path=path, recipe=as_recipe(self.recipe),
                              precision=self.precision)
             for name, (_, path, _) in proj.items()}
    weights = {n: whole(w)[0] for n, (w, _, _) in proj.items()}
    y, aux = moe_forward(
        x, whole(router)[0], weights,
        {n: k for n, (_, _, k) in proj.items()}, gemms, top_k=self.top_k,
        capacity_factor=self.capacity_factor)
    self.sow("losses", AUX_LOSS, aux)
    return restore(y.reshape(shape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertGemm:
  """The grouped GEMM of one expert projection (a static value): its path
  for the precision rules, its own recipe (None: the rules'), the rules it
  was switched with (NNX), the precision of high-precision GEMMs."""

  path: str | None = None
  recipe: Recipe | None = None
  rules: PrecisionRules | None = None
  precision: Any = None

  def __call__(self, x, w, group_sizes, *, key=None, first_expert=0,
               aligned: int = 1):
    """`aligned`: every group already starts on a multiple of this many
    rows (the layer's padded dispatch)."""
    path = self.path or ""
    dtype = x.dtype
    observe_input(path, x, group_sizes)

    def run(r: Recipe, k):
      a, b = x, w
      if not r.quantized:
        a, b = x.astype(dtype), w.astype(dtype)
      need = (alignment(r.wgrad_x, r.rht_size)
              if r.gemm_format("wgrad") != "bf16" else 1)
      return ragged_dot(a, b, group_sizes, self.precision, dtype, recipe=r,
                        key=k, name=path, first_expert=first_expert,
                        align="assume" if aligned % need == 0 else "pad")
    return layer_call(run, recipe=self.recipe, path=path, key=key,
                      rules=self.rules)


# ----------------------------------------------------------------------------
# NNX.
# ----------------------------------------------------------------------------


class NNXMoE(nnx.Module):
  """`NVFP4MoE` for flax NNX: the same routing, experts and loss.

  State: `router` `[D, E]` (FP32), `up` `[E, D, 2H]`, `down` `[E, H, D]`
  (`nnx.Param`s). `__call__(x)` returns `y`; the last call's load-balancing
  loss is `self.aux_loss` (an `nnx.Intermediate`). Keys for stochastic
  rounding come from an "nvfp4" RNG stream if `rngs` has one, else from the
  step of `precision_rules` and the paths `apply_rules` sets
  (".../experts/up", ".../experts/down").

  Args:
    features: the model width D (input and output).
    num_experts: E.
    hidden: each expert's hidden width H.
    top_k: experts per token.
    capacity_factor: None (dropless) or the capacity factor, as
      `NVFP4MoE.capacity_factor`.
    recipe: the expert GEMMs' `Recipe` or a preset's name; None for the
      rules' by path.
    kernel_init: each expert's `[in, out]` initializer.
    router_init: the FP32 router's `[D, E]` initializer.
    param_dtype: of the expert kernels (FP32 master weights).
    precision: of high-precision expert GEMMs.
    rngs: `nnx.Rngs`; its "params" stream initializes the state, an "nvfp4"
      stream (if any) seeds stochastic rounding.

  Raises:
    ValueError: `num_experts`, `top_k` or `capacity_factor` out of range.
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
    self.up_gemm = ExpertGemm(recipe=recipe, precision=precision)
    self.down_gemm = ExpertGemm(recipe=recipe, precision=precision)
    if RNG_STREAM in rngs:
      self.sr_rngs = rngs[RNG_STREAM].fork()
    self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    x, restore = whole(x)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    keys = {n: self.sr_rngs() if hasattr(self, "sr_rngs") else None
            for n in ("up", "down")}
    y, aux = moe_forward(
        x, whole(self.router[...])[0],
        {"up": whole(self.up[...])[0], "down": whole(self.down[...])[0]},
        keys, {"up": self.up_gemm, "down": self.down_gemm}, top_k=self.top_k,
        capacity_factor=self.capacity_factor)
    self.aux_loss = nnx.Intermediate(aux)
    return restore(y.reshape(shape))

