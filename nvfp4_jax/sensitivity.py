"""Layer sensitivity analysis: which linear layers suffer most from NVFP4.

The paper observes that the last layers' weight gradients carry the largest
FP4 quantization error and suggests such metrics could choose the layers kept
in high precision. `analyze` measures, per NVFP4 layer of a linen model and
over a few batches, how far each of its three GEMMs lands from high
precision when its operands are quantized with a recipe:

- `fprop_err`, `dgrad_err`, `wgrad_err`: `||GEMM_q - GEMM_hp|| / ||GEMM_hp||`
  for `Y = X W`, `dX = dY W^T`, `dW = X^T dY` (the recipe's quantized GEMM,
  stochastic rounding included, against the same GEMM in FP32);
- `x_flushed`, `x_saturated` (and `w_`, `dy_`): the fraction of nonzero values
  that dequantize to zero and of blocks that saturate (`tensor_stats`);

then `suggest_rules` ranks the layers and keeps the most sensitive ones (a
budget, e.g. 15% of the linear layers) in BF16.

The activations and output gradients are the model's own: a forward pass
records each layer's input, and a zero probe added to each layer's output
gives its output gradient `dY` as the loss's gradient with respect to it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax import nvfp4
from nvfp4_jax.layers import NVFP4Dense
from nvfp4_jax.ops import dot_general
from nvfp4_jax.quant import dequantize
from nvfp4_jax.recipe import Recipe
from nvfp4_jax.rules import PrecisionRules
from nvfp4_jax.rules import precision_rules

METRICS = ("fprop_err", "dgrad_err", "wgrad_err")
_CLIP = 7.0  # Scaled magnitudes above this were clipped by more than RTNE.


def tensor_stats(x: jax.Array, *, block_2d: bool = False,
                 **quantize_kwargs) -> dict[str, jax.Array]:
  """What NVFP4 does to `x: [M, K]`: flushed-to-zero fraction, saturated
  block fraction and relative error.

  - `flushed`: the fraction of nonzero values that dequantize to zero;
  - `saturated`: the fraction of blocks (16x16 tiles with `block_2d`) with a
    value whose scaled magnitude exceeds 7 (the midpoint between 6 and the 8
    a grid without a top would have): clipped by more than rounding moves a
    value, which happens when a block scale fell into E4M3's subnormal range;
  - `rel_err`: `||x - dq(q(x))|| / ||x||`.
  """
  xf = x.astype(jnp.float32)
  q = nvfp4.quantize(xf, block_2d=block_2d, **quantize_kwargs)
  dq = dequantize(q)
  nonzero = xf != 0
  flushed = jnp.sum(nonzero & (dq == 0)) / jnp.maximum(jnp.sum(nonzero), 1)
  m, k = xf.shape
  cap = _CLIP * q.scales.astype(jnp.float32) * q.tensor_scale  # [M, K/16]
  over = (jnp.abs(xf).reshape(m, k // 16, 16) > cap[..., None]) & (
      cap > 0)[..., None]
  sat = jnp.any(over, axis=-1)
  if block_2d:
    sat = jnp.any(sat.reshape(m // 16, 16, k // 16), axis=1)
  err = jnp.linalg.norm(xf - dq) / jnp.maximum(jnp.linalg.norm(xf), 1e-30)
  return {"flushed": flushed, "saturated": jnp.mean(sat), "rel_err": err}


@dataclasses.dataclass(frozen=True)
class LayerSensitivity:
  """One layer's measurements (means over the batches).

  Attributes:
    path: the layer's module path.
    stats: metric name -> value (see the module docstring).
  """

  path: str
  stats: dict[str, float]

  def score(self, metric: str = "max") -> float:
    """The ranking score: one metric, or "max" of the three GEMM errors."""
    if metric == "max":
      return max(self.stats[m] for m in METRICS)
    return self.stats[metric]


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def _hp(a, b):
  return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


def _capturer(loss: Callable, params: Any, batch: Any):
  """A jitted `batch -> {path: (x, w, dy)}`: each NVFP4Dense's input `x`,
  kernel `w` and output gradient `dy` (compiled once for batches shaped like
  `batch`)."""

  def run(probes, batch):
    inputs: dict[str, jax.Array] = {}

    def interceptor(next_fun, fargs, fkwargs, context):
      m = context.module
      if not (isinstance(m, NVFP4Dense) and context.method_name == "__call__"):
        return next_fun(*fargs, **fkwargs)
      path = "/".join(str(p) for p in m.scope.path)
      inputs[path] = fargs[0]
      y = next_fun(*fargs, **fkwargs)
      return y + probes[path].astype(y.dtype) if probes else y
    # Measured on the activations and gradients of the unquantized model.
    with precision_rules(PrecisionRules.high_precision()), \
        nn.intercept_methods(interceptor):
      value = loss(params, batch)
    return value, inputs

  outputs: dict[str, Any] = {}

  def shapes(batch):
    def interceptor(next_fun, fargs, fkwargs, context):
      y = next_fun(*fargs, **fkwargs)
      m = context.module
      if isinstance(m, NVFP4Dense) and context.method_name == "__call__":
        outputs["/".join(str(p) for p in m.scope.path)] = y
      return y
    with precision_rules(PrecisionRules.high_precision()), \
        nn.intercept_methods(interceptor):
      return loss(params, batch)
  jax.eval_shape(shapes, batch)
  if not outputs:
    raise ValueError("analyze: the loss ran no NVFP4Dense layer; replace the "
                     "model's nn.Dense layers with nvfp4_jax.NVFP4Dense.")
  grads = jax.jit(jax.grad(run, has_aux=True))
  p = params["params"] if set(params) == {"params"} else params

  def kernel(path):
    node = p
    for part in path.split("/"):
      node = node[part]
    return node["kernel"]

  def capture(batch):
    probes = {p: jnp.zeros(s.shape, jnp.float32) for p, s in outputs.items()}
    dys, inputs = grads(probes, batch)
    return {path: (inputs[path], kernel(path), dys[path]) for path in outputs}
  return capture


def layer_stats(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe,
                key: jax.Array) -> dict[str, jax.Array]:
  """The metrics of one layer: `x [..., in]`, `w [in, out]`, `dy [..., out]`."""
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  dy = dy.reshape(-1, dy.shape[-1]).astype(jnp.float32)
  w = w.astype(jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  y_q, vjp = jax.vjp(lambda x, w: dot_general(x, w, dn, recipe=recipe,
                                              key=key), x, w)
  dx_q, dw_q = vjp(dy)
  stats = {"fprop_err": _rel(y_q, _hp(x, w)),
           "dgrad_err": _rel(dx_q, _hp(dy, w.T)),
           "wgrad_err": _rel(dw_q, _hp(x.T, dy))}
  for name, t, b2 in (("x", x, False), ("w", w.T, True), ("dy", dy, False)):
    s = tensor_stats(t, block_2d=b2 and t.shape[0] % 16 == 0)
    stats[f"{name}_flushed"] = s["flushed"]
    stats[f"{name}_saturated"] = s["saturated"]
  return stats


def analyze(loss: Callable[[Any, Any], jax.Array], params: Any,
            batches: Sequence[Any], *, recipe: Recipe | None = None,
            key: jax.Array | None = None) -> list[LayerSensitivity]:
  """Measures every NVFP4 layer that `loss` runs, over `batches`.

  Args:
    loss: `loss(params, batch) -> scalar`, applying a linen model whose
      linear layers are `NVFP4Dense`, e.g. `lambda p, b: xent(model.apply(p,
      b[:, :-1]), b[:, 1:])`. It runs in high precision here.
    params: the model's variables.
    batches: a few batches.
    recipe: the recipe whose error is measured (default `Recipe.nvfp4()`).
    key: stochastic-rounding key.

  Returns:
    One `LayerSensitivity` per layer, in the model's order.
  """
  recipe = recipe or Recipe.nvfp4()
  key = jax.random.key(0) if key is None else key
  stats_fn = jax.jit(lambda x, w, dy, k: layer_stats(x, w, dy, recipe, k))
  totals: dict[str, dict[str, float]] = {}
  capture = None
  for i, batch in enumerate(batches):
    if capture is None or jax.tree.map(jnp.shape, batch) != first:
      capture, first = _capturer(loss, params, batch), jax.tree.map(
          jnp.shape, batch)
    for j, (path, (x, w, dy)) in enumerate(capture(batch).items()):
      s = jax.device_get(stats_fn(x, w, dy,
                                  jax.random.fold_in(key, i * 4096 + j)))
      acc = totals.setdefault(path, {})
      for name, v in s.items():
        acc[name] = acc.get(name, 0.0) + float(v) / len(batches)
  return [LayerSensitivity(p, s) for p, s in totals.items()]


def suggest_rules(results: Sequence[LayerSensitivity], *,
                  budget: float = 0.15, metric: str = "max",
                  recipe: Recipe | None = None, base: PrecisionRules | None
                  = None) -> PrecisionRules:
  """`PrecisionRules` that keep the most sensitive layers in BF16.

  Args:
    results: `analyze`'s output.
    budget: the fraction of the linear layers kept in BF16 (rounded up).
    metric: the ranking score: "max" of the three GEMM errors, or one metric.
    recipe: the recipe of every other layer (default `Recipe.nvfp4()`).
    base: rules whose late switch to keep.

  Returns:
    `PrecisionRules` with one exact-path rule per kept layer.
  """
  if not 0 <= budget <= 1:
    raise ValueError(f"budget={budget} must be a fraction in [0, 1].")
  ranked = sorted(results, key=lambda r: -r.score(metric))
  keep = ranked[:math.ceil(budget * len(ranked) - 1e-9)]
  rules = tuple((f"^{re.escape(r.path)}$", Recipe.bf16()) for r in keep)
  kw = {} if recipe is None else {"default": recipe}
  return PrecisionRules(rules=rules, late_switch=base.late_switch if base
                        else None, **kw)


def table(results: Sequence[LayerSensitivity], metric: str = "max") -> str:
  """A printable ranking, most sensitive first."""
  cols = ("fprop_err", "dgrad_err", "wgrad_err", "x_flushed", "dy_flushed",
          "w_saturated")
  ranked = sorted(results, key=lambda r: -r.score(metric))
  width = max([len("layer")] + [len(r.path) for r in ranked])
  lines = ["  ".join(["layer".ljust(width), *(c.rjust(11) for c in cols)])]
  for r in ranked:
    lines.append("  ".join([r.path.ljust(width),
                            *(f"{r.stats[c]:11.4f}" for c in cols)]))
  return "\n".join(lines)
