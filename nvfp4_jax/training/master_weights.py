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
    master: the master copy of the floating and complex parameters, in
      `master_dtype` of each (FP32 for bf16/fp16/fp32, complex64 for
      complex64; the inner transformation updates it); integer and bool
      leaves are held as they are, unchanged.
    inner_state: the inner transformation's state (built on `master`, with
      None in place of the integer and bool leaves).
  """

  master: optax.Params
  inner_state: optax.OptState


def _trained(x) -> bool:
  """Whether a parameter leaf is one the optimizer moves: a real or complex
  float (`jnp.inexact`)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def master_dtype(dtype) -> jnp.dtype:
  """The master copy's dtype for a parameter of `dtype` (floating or
  complex): at least FP32, never narrower than the parameter, and of its
  kind. bf16, fp16 and fp32 give fp32; complex64 gives complex64 (two FP32
  parts: a real master would drop the imaginary part); fp64 and complex128
  (with `jax_enable_x64`) keep their own precision.
  """
  return jnp.promote_types(dtype, jnp.float32)


def _floats(tree, like):
  """`tree` with None where `like` (the parameters) has an untrained leaf."""
  return jax.tree_util.tree_map(lambda x, p: x if _trained(p) else None,
                                tree, like)


def _grads(updates, params):
  """The gradients of the trained parameters in their master's dtype (None
  elsewhere)."""
  def cast(g, p):
    if not _trained(p):
      return None  # An int/bool parameter's gradient (float0...) is unused.
    gt, pt = jnp.result_type(g), jnp.result_type(p)
    if jax.dtypes.result_type(g) == jax.dtypes.float0 or not jnp.issubdtype(
        gt, jnp.inexact):
      raise TypeError(
          f"master_weights: a {pt} parameter of shape {jnp.shape(p)} got a "
          f"gradient of dtype {gt}; pass the gradients jax.grad returns for "
          f"these params (a float0 gradient belongs to an integer "
          f"parameter).")
    if (jnp.issubdtype(gt, jnp.complexfloating)
        and not jnp.issubdtype(pt, jnp.complexfloating)):
      raise TypeError(
          f"master_weights: a real {pt} parameter of shape {jnp.shape(p)} "
          f"got a complex gradient ({gt}); its imaginary part has nowhere "
          f"to go. Make the parameter complex, or pass the real gradient "
          f"(e.g. jnp.real(g) if that is what is meant).")
    return jnp.asarray(g, master_dtype(pt))
  return jax.tree_util.tree_map(cast, updates, params)


def master_weights(inner: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
  """Runs `inner` on an FP32 master copy of the parameters.

  Gradients are cast to the master's dtype (`master_dtype`: FP32 for real
  parameters up to FP32, complex64 for complex64 ones), `inner` updates the
  master in it, and the
  returned updates move each parameter to the new master cast to the
  parameter's dtype: `optax.apply_updates(params, updates)` gives
  `new_master.astype(params.dtype)`, whatever XLA fuses on either side. The
  update, in the parameter's dtype, is the difference of the new and the old
  parameter, which is exact -- and so is the sum -- whenever the weight moves
  by less than its own magnitude in one step (every ordinary step). A weight
  that crosses or collapses to zero in one step lands within one ulp of the
  old weight's scale instead. Updates too small to move a bf16 weight still
  accumulate in the master.

  Floating and complex parameters are trained; a complex parameter keeps a
  complex master, so its steps are `inner`'s own (optax treats complex
  parameters as pairs of reals: `optax.sgd`, `optax.adam`, ...). Integer and
  bool leaves (counters, masks, ...) are left untouched: `inner` does not
  see them, their update is zero whatever their gradient (`float0` from
  `jax.grad(..., allow_int=True)` included), and the master holds them as
  they are.

  Args:
    inner: the optimizer to run in FP32 (e.g. `optax.adamw(...)`).

  Returns:
    An `optax.GradientTransformation` whose `update` needs `params`.

  Raises:
    TypeError (in `update`): a floating or complex parameter whose gradient
      is not (e.g. `float0`), or a real parameter with a complex gradient.
  """

  def init_fn(params):
    master = jax.tree_util.tree_map(
        lambda p: jnp.asarray(p, master_dtype(jnp.result_type(p)))
        if _trained(p) else p, params)
    return MasterWeightsState(
        master=master, inner_state=inner.init(_floats(master, params)))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "master_weights needs params: call tx.update(grads, state, params).")
    grads = _grads(updates, params)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, _floats(state.master, params))
    moved = optax.apply_updates(_floats(state.master, params), inner_updates)
    master = jax.tree_util.tree_map(
        lambda m, p: m if _trained(p) else p, moved, params,
        is_leaf=lambda x: x is None)

    def param_update(new, p):
      if not _trained(p):
        return jnp.zeros_like(p)
      # In the parameter's dtype (optax wrappers like apply_if_finite need the
      # updates' dtype to match the gradients').
      # The barrier keeps XLA:GPU from eliding the rounding to p.dtype
      # ("excess precision"), which would make the sum miss the cast master.
      rounded = jax.lax.optimization_barrier(new.astype(p.dtype))
      delta = rounded.astype(new.dtype) - p.astype(new.dtype)
      return delta.astype(p.dtype)
    out = jax.tree_util.tree_map(param_update, master, params)
    return out, MasterWeightsState(master=master, inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def master_params(opt_state: Any) -> optax.Params:
  """The FP32 master parameters held in `opt_state` (found at any depth).

  Args:
    opt_state: the optimizer state of a `master_weights(...)` optimizer, or
      any pytree holding its `MasterWeightsState`.

  Returns:
    The `master` tree of the first `MasterWeightsState` found.

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
