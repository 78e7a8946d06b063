"""Per-layer NVFP4 quantization diagnostics, sampled outside the hot path.

For every `NVFP4Dense` of a model, during a forward pass, this quantizes what the
layer's forward GEMM sees — its input `X` (`[tokens, in]`, 1x16 blocks) and its
weight `W = kernel^T` (16x16 tiles) — with `nvfp4_jax.quantize` (RTNE) and
reports:

- `*_flushed`: the fraction of nonzero values that dequantize to zero (below
  half the smallest FP4 step of their block, or in a block whose E4M3 scale
  underflowed);
- `*_saturated`: the fraction of blocks (tiles for `W`) in which some value
  was clipped: its scaled magnitude exceeds 7, the midpoint between the
  largest FP4 value 6 and the next value 8 an FP4 grid without a top would
  have, so saturation changed it more than rounding would have. The E4M3
  rounding of a normal block scale moves the block max by at most 1/16 (to
  <= 6.375), so this counts blocks whose scale fell into E4M3's subnormal
  range, where it rounds coarsely — a failure of the two-level scaling, not
  the routine clip of the block max to 6;
- `*_rel_err`: `||x - dq(q(x))|| / ||x||`.

The inputs are captured with a flax method interceptor during a forward pass
under the run's precision rules, so they are the activations training sees.
Layers kept in high precision by the rules are measured too (what NVFP4 would
do to them) and flagged `quantized: false`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import nvfp4_jax

_BLOCK = 16
# Scaled magnitudes above this were clipped by more than RTNE would move them.
_CLIP = 7.0


def tensor_stats(x: jax.Array, *, block_2d: bool) -> dict[str, jax.Array]:
  """Flushed-to-zero fraction, saturated-block fraction and relative error.

  Args:
    x: `[M, K]`, K (and M for `block_2d`) a multiple of 16.
    block_2d: 16x16 tile scales (weights) instead of 1x16 blocks.
  """
  xf = x.astype(jnp.float32)
  q = nvfp4_jax.quantize(xf, block_2d=block_2d)
  dq = nvfp4_jax.dequantize(q)
  nonzero = xf != 0
  flushed = jnp.sum(nonzero & (dq == 0)) / jnp.maximum(jnp.sum(nonzero), 1)
  m, k = xf.shape
  # The largest unclipped magnitude of each block, `7 * d * amax / 2688`.
  cap = _CLIP * q.scales.astype(jnp.float32) * (q.amax / 2688.0)  # [M, K/16]
  # A block whose scale underflowed to 0 dequantizes to zeros: flushed, not
  # saturated.
  over = (jnp.abs(xf).reshape(m, k // _BLOCK, _BLOCK) > cap[..., None]) & (
      cap > 0)[..., None]
  sat = jnp.any(over, axis=-1)                                    # [M, K/16]
  if block_2d:
    sat = jnp.any(sat.reshape(m // _BLOCK, _BLOCK, k // _BLOCK), axis=1)
  err = jnp.linalg.norm(xf - dq) / jnp.maximum(jnp.linalg.norm(xf), 1e-30)
  return {"flushed": flushed, "saturated": jnp.mean(sat), "rel_err": err}


def _get(tree: Any, path: str) -> Any:
  for part in path.split("/"):
    tree = tree[part]
  return tree


def with_diagnostics(apply_fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a forward pass to also return the diagnostics of its layers.

  Args:
    apply_fn: `apply_fn(params, *args)` runs the model's forward pass (with its
      precision rules and RNGs); every `NVFP4Dense` it calls is measured.

  Returns:
    `diag(params, *args) -> (apply_fn's output, {layer path: {stat: scalar}})`
    to call under `jax.jit`; per layer the stats are `x_flushed`,
    `x_saturated`, `x_rel_err` and the same for `w_`.
  """

  def diag(params, *args):
    inputs: dict[str, jax.Array] = {}

    def interceptor(next_fun, fargs, fkwargs, context):
      m = context.module
      if isinstance(m, nvfp4_jax.NVFP4Dense) and context.method_name == "__call__":
        path = "/".join(str(p) for p in m.scope.path)
        inputs[path] = fargs[0]
      return next_fun(*fargs, **fkwargs)

    with nn.intercept_methods(interceptor):
      result = apply_fn(params, *args)
    tensors = {}
    for path, x in inputs.items():
      tensors[("x", path)] = x.reshape(-1, x.shape[-1])
      tensors[("w", path)] = _get(params, path)["kernel"].T
    # One vmapped quantization per distinct shape keeps the compile small.
    groups: dict[tuple, list] = {}
    for (kind, path), t in tensors.items():
      groups.setdefault((kind, t.shape, t.dtype), []).append(path)
    out: dict[str, dict[str, jax.Array]] = {p: {} for p in sorted(inputs)}
    for (kind, _, _), paths in groups.items():
      stacked = jnp.stack([tensors[(kind, p)] for p in paths])
      stats = jax.vmap(functools.partial(
          tensor_stats, block_2d=kind == "w"))(stacked)
      for i, p in enumerate(paths):
        out[p].update({f"{kind}_{k}": v[i] for k, v in stats.items()})
    return result, out

  return diag
