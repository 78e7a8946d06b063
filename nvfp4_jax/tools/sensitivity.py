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

`sr_bias` checks that a recipe's stochastically rounded backward GEMMs are
unbiased on the same captured tensors: the mean of many SR draws of Dgrad and
Wgrad against their expectation given the round-to-nearest operands (see its
docstring).

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

from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.flax.linen import NVFP4Dense
from nvfp4_jax.training.dot_general import dot_general
from nvfp4_jax.ops.block_values.api import dequantize
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import precision_rules

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
  q = quantize_api.quantize(xf, block_2d=block_2d, **quantize_kwargs)
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


SR_BIAS_METRICS = ("err_1", "err_mean", "bias_ratio", "rtne_err")


def _sr_expectations(x, w, dy, recipe: Recipe):
  """`{gemm: E[gemm] given the RTNE operands}` for the GEMMs whose dY operand
  rounds stochastically (dY's quantization replaced by dY itself)."""
  from nvfp4_jax.ops.quantize.api import quantize_operand  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.quantize_pair.api import quantize_pair  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.core.hadamard import rht  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.core.recipe import Operand  # pylint: disable=g-import-not-at-top
  out = {}
  if recipe.dgrad_dy.rounding == "stochastic":
    if recipe.dgrad_w.rounding == "stochastic":
      raise ValueError("sr_bias: the Dgrad weight rounds stochastically too; "
                       "the expectation is defined here for dY's SR only.")
    if recipe.dgrad_w == recipe.fprop_w and recipe.fprop_w.block_2d:
      # Dgrad reuses Fprop's 16x16 weight (`[out, in]`).
      w_q = dequantize(quantize_operand(w.T, recipe.fprop_w, None))
    else:
      w_q = dequantize(quantize_operand(w, recipe.dgrad_w, None)).T
    out["dgrad"] = _hp(dy, w_q)
  if recipe.wgrad_dy.rounding == "stochastic":
    if recipe.wgrad_x.rounding == "stochastic":
      raise ValueError("sr_bias: the Wgrad X operand rounds stochastically "
                       "too; the expectation is defined here for dY's SR only.")
    _, q_xt = quantize_pair(x, Operand(format="bf16"), recipe.wgrad_x,
                            rht_size=recipe.rht_size,
                            sign_vector=recipe.rht_sign_vector)
    dyt = dy.T
    if recipe.wgrad_dy.rht:
      dyt = rht(dyt, sign_vector=recipe.rht_sign_vector,
                size=recipe.rht_size).astype(jnp.float32)
    out["wgrad"] = _hp(dequantize(q_xt), dyt.T)
  return out


def sr_bias(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe,
            key: jax.Array, draws: int = 64) -> dict[str, dict[str, jax.Array]]:
  """Is a layer's stochastically rounded gradient unbiased? Per SR GEMM.

  Given the round-to-nearest operands (the weight in Dgrad, X^T after the RHT
  in Wgrad), stochastic rounding of dY must leave the GEMM's expectation
  `E` equal to the same GEMM with dY unquantized. Over `draws` keys:

  - `err_1`: `||G_k - E|| / ||E||`, one draw (RMS over the draws);
  - `err_mean`: `||mean_k G_k - E|| / ||E||`;
  - `bias_ratio`: `sqrt(draws) * err_mean / err_1`: ~1 for unbiased
    rounding (independent draws average down as 1/sqrt(draws)), up to
    `sqrt(draws)` for a deterministic error (e.g. round-to-nearest);
  - `rtne_err`: `||E - G_hp|| / ||G_hp||`, what the RTNE operands alone cost
    against FP32, for scale.

  Args:
    x, w, dy: a layer's input `[..., in]`, kernel `[in, out]` and output
      gradient `[..., out]` (e.g. from `analyze`'s capture).
    recipe: a recipe whose dY operands round stochastically (the paper's).
    key: the draws' base key.
    draws: the number of SR draws.

  Returns:
    `{"dgrad": {metric: value}, "wgrad": {...}}` for the GEMMs with SR.
  """
  if draws < 2:
    raise ValueError(f"sr_bias: draws={draws}; use at least 2 (the bias ratio "
                     f"compares the mean of the draws with one draw).")
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  dy = dy.reshape(-1, dy.shape[-1]).astype(jnp.float32)
  w = w.astype(jnp.float32)
  expect = _sr_expectations(x, w, dy, recipe)
  if not expect:
    raise ValueError(f"sr_bias: {recipe!r} rounds no dY operand "
                     f"stochastically; nothing to measure.")
  dn = (((1,), (0,)), ((), ()))

  def grads(k):
    _, vjp = jax.vjp(lambda x, w: dot_general(x, w, dn, recipe=recipe,
                                              key=k), x, w)
    dx, dw = vjp(dy)
    return {"dgrad": dx.astype(jnp.float32), "wgrad": dw.astype(jnp.float32)}

  def body(carry, k):
    g = grads(k)
    sq = {n: carry[1][n] + jnp.sum((g[n] - e) ** 2) for n, e in expect.items()}
    total = {n: carry[0][n] + g[n] for n in expect}
    return (total, sq), None

  zero = ({n: jnp.zeros_like(e) for n, e in expect.items()},
          {n: jnp.zeros((), jnp.float32) for n in expect})
  (total, sq), _ = jax.lax.scan(body, zero, jax.random.split(key, draws))
  hp = {"dgrad": _hp(dy, w.T), "wgrad": _hp(x.T, dy)}
  out = {}
  for n, e in expect.items():
    norm = jnp.maximum(jnp.linalg.norm(e), 1e-30)
    err_1 = jnp.sqrt(sq[n] / draws) / norm
    err_mean = jnp.linalg.norm(total[n] / draws - e) / norm
    out[n] = {"err_1": err_1, "err_mean": err_mean,
              "bias_ratio": math.sqrt(draws) * err_mean
              / jnp.maximum(err_1, 1e-30),
              "rtne_err": _rel(e, hp[n])}
  return out


def sr_bias_table(results: dict[str, dict[str, dict[str, float]]],
                  draws: int) -> str:
  """A printable table of `{layer: sr_bias(...)}` (floats)."""
  width = max([len("layer")] + [len(p) for p in results])
  head = ["layer".ljust(width), "gemm ", *(c.rjust(10)
                                          for c in SR_BIAS_METRICS)]
  lines = [f"stochastic rounding bias over {draws} draws (bias_ratio ~1: "
           f"unbiased; ~{math.sqrt(draws):.0f}: deterministic)", "",
           "  ".join(head)]
  for path, gemms in results.items():
    for g, m in gemms.items():
      lines.append("  ".join([path.ljust(width), g.ljust(5),
                              *(f"{m[c]:10.4f}" for c in SR_BIAS_METRICS)]))
  return "\n".join(lines)


def analyze_sr_bias(loss: Callable[[Any, Any], jax.Array], params: Any,
                    batch: Any, *, recipe: Recipe | None = None,
                    key: jax.Array | None = None, draws: int = 64,
                    layers: Sequence[str] | None = None
                    ) -> dict[str, dict[str, dict[str, float]]]:
  """`sr_bias` of every NVFP4 layer that `loss` runs (or of `layers`), on
  the model's own tensors of one batch (see `analyze`)."""
  recipe = recipe or Recipe.nvfp4()
  key = jax.random.key(0) if key is None else key
  fn = jax.jit(lambda x, w, dy, k: sr_bias(x, w, dy, recipe, k, draws))
  captured = _capturer(loss, params, batch)(batch)
  unknown = sorted(set(layers or ()) - set(captured))
  if unknown:
    raise ValueError(f"analyze_sr_bias: no NVFP4 layer {unknown} in the "
                     f"model; its layers are {sorted(captured)}.")
  out = {}
  for j, (path, (x, w, dy)) in enumerate(captured.items()):
    if layers is not None and path not in layers:
      continue
    res = jax.device_get(fn(x, w, dy, jax.random.fold_in(key, j)))
    out[path] = {g: {m: float(v) for m, v in d.items()}
                 for g, d in res.items()}
  return out


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
