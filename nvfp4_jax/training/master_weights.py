"""FP32 master weights as an optax gradient transformation.

    tx = nvfp4_jax.master_weights(optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule)))
    opt_state = tx.init(params)                 # params may be bf16
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    eval_params = nvfp4_jax.master_params(opt_state)   # FP32

It wraps like `optax.apply_if_finite` and composes with `optax.chain`,
`optax.MultiSteps` and `optax.apply_if_finite` on either side.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    master: FP32 copy of the parameters; the inner transformation updates it.
    inner_state: the inner transformation's state (built on `master`).
  """

  master: optax.Params
  inner_state: optax.OptState


def _f32(tree):
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), tree)


def master_weights(inner: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
  """Runs `inner` on an FP32 master copy of the parameters.

  Gradients are cast to FP32, `inner` updates the master in FP32, and the
  returned updates move each parameter to the new master cast to the
  parameter's dtype: `optax.apply_updates(params, updates)` gives
  `new_master.astype(params.dtype)`, whatever XLA fuses on either side. The
  update, in the parameter's dtype, is the difference of the new and the old
  parameter, which is exact -- and so is the sum -- whenever the weight moves
  by less than its own magnitude in one step (every ordinary step). A weight
  that crosses or collapses to zero in one step lands within one ulp of the
  old weight's scale instead. Updates too small to move a bf16 weight still
  accumulate in the master.

  Args:
    inner: the optimizer to run in FP32 (e.g. `optax.adamw(...)`).

  Returns:
    An `optax.GradientTransformation` whose `update` needs `params`.
  """

  def init_fn(params):
    master = _f32(params)
    return MasterWeightsState(master=master, inner_state=inner.init(master))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "master_weights needs params: call tx.update(grads, state, params).")
    grads = _f32(updates)
    inner_updates, inner_state = inner.update(grads, state.inner_state,
                                              state.master)
    master = optax.apply_updates(state.master, inner_updates)

    def param_update(new, p):
      # In the parameter's dtype (optax wrappers like apply_if_finite need the
      # updates' dtype to match the gradients').
      # The barrier keeps XLA:GPU from eliding the rounding to p.dtype
      # ("excess precision"), which would make the sum miss the cast master.
      rounded = jax.lax.optimization_barrier(new.astype(p.dtype))
      delta = rounded.astype(jnp.float32) - p.astype(jnp.float32)
      return delta.astype(p.dtype)
    out = jax.tree_util.tree_map(param_update, master, params)
    return out, MasterWeightsState(master=master, inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def master_params(opt_state: Any) -> optax.Params:
  """The FP32 master parameters held in `opt_state` (found at any depth).

  Raises:
    ValueError: if `opt_state` holds no `MasterWeightsState`.
  """
  found = []

  def visit(node):
    if isinstance(node, MasterWeightsState):
      found.append(node.master)
      return True
    return False
  jax.tree_util.tree_map(lambda _: None, opt_state, is_leaf=visit)
  if not found:
    raise ValueError("opt_state holds no MasterWeightsState: build the "
                     "optimizer with nvfp4_jax.master_weights(...).")
  return found[0]
