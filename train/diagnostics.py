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
from nvfp4_jax.tools.sensitivity import tensor_stats


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
    # One quantization per distinct shape, looped over the layers with
    # `lax.map`, keeps the compile small and the memory to the stacked
    # inputs plus one layer's temporaries (a vmap held every layer's at
    # once: 23.9 GiB a GPU for GPT base's evaluation at 16 x 1024 tokens,
    # which ran a 4-GPU run out of memory; 5.1 GiB with the loop).
    groups: dict[tuple, list] = {}
    for (kind, path), t in tensors.items():
      groups.setdefault((kind, t.shape, t.dtype), []).append(path)
    out: dict[str, dict[str, jax.Array]] = {p: {} for p in sorted(inputs)}
    for (kind, _, _), paths in groups.items():
      stacked = jnp.stack([tensors[(kind, p)] for p in paths])
      stats = jax.lax.map(functools.partial(
          tensor_stats, block_2d=kind == "w"), stacked)
      for i, p in enumerate(paths):
        out[p].update({f"{kind}_{k}": v[i] for k, v in stats.items()})
    return result, out

  return diag
