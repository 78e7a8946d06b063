"""The pure functions of a training run: gradients, the optimizer step, eval.

One optimizer step (`StepFunctions.train_step`, jitted by the `Trainer`):

1. `loss_and_grads` consumes the batch `[grad_accum, micro_batch, seq_len + 1]`
   with a `lax.scan` over micro-batches, each a forward and backward pass of
   the GPT under the run's `nvfp4_jax.precision_rules` (traced `step`, so the
   late switch flips without recompiling) with a fresh stochastic-rounding key
   `fold_in(fold_in(sr_key, step), micro)` on the "nvfp4" RNG stream, and
   returns the mean loss and the mean FP32 gradients;
2. if any of them is NaN/Inf the step is skipped — parameters and optimizer
   state are returned unchanged (a select per element), and `skipped`
   counts it;
3. otherwise `master_weights(chain(clip_by_global_norm, adamw(WSD)))` updates
   the FP32 master and the model's parameters.

Everything that varies between steps is a function of `(seed, step)` or of the
state, so a run restored from a checkpoint continues bit-identically.

On a device mesh (`mesh_rules`, a `nvfp4_jax.MeshRules`) the model runs
under `nvfp4_jax.mesh_rules`: its NVFP4 layers run sharded, and the FP32
gradient accumulators are kept sharded like the parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import nvfp4_jax
from train.config import TrainConfig
from train.diagnostics import with_diagnostics


class TrainState(NamedTuple):
  """Everything a checkpoint holds.

  Attributes:
    step: int32, optimizer steps taken (skipped ones included).
    params: the model's parameters (in the compute dtype).
    opt_state: the `master_weights` state, with the FP32 master copy.
    skipped: int32, steps skipped for a NaN/Inf loss or gradient.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, in FP32, over every position."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all()


class StepFunctions:
  """The pure functions of a run, closed over its model, rules and optimizer.

  None of them keeps state between calls: what changes from step to step is
  an argument (`TrainState`, the batch, the step), and every random key is a
  function of `(cfg.seed, step)`.

  Args:
    cfg: the run's `TrainConfig` (seed, sequence length, diagnostics).
    model: the flax module, applied as `model.apply({"params": p}, tokens)`.
    rules: the run's `nvfp4_jax.PrecisionRules`.
    optimizer: an optimizer whose `update` needs the parameters (the
      `master_weights` wrapper).
    schedule: its learning-rate schedule, reported in the step's metrics.
    mesh_rules: how to shard the run over a device mesh; None: one device.
  """

  def __init__(self, cfg: TrainConfig, model: nn.Module,
               rules: nvfp4_jax.PrecisionRules,
               optimizer: optax.GradientTransformation,
               schedule: optax.Schedule,
               mesh_rules: nvfp4_jax.MeshRules | None = None):
    self.cfg = cfg
    self.model = model
    self.rules = rules
    self.optimizer = optimizer
    self.schedule = schedule
    self.mesh_rules = mesh_rules
    base = jax.random.key(cfg.seed)
    self._init_key = jax.random.fold_in(base, 0)
    self._sr_key = jax.random.fold_in(base, 1)
    self._eval_key = jax.random.fold_in(base, 2)

  def forward(self, params, tokens: jax.Array, step, key) -> jax.Array:
    """Logits of `tokens: int32 [batch, seq]` under the rules at `step`."""
    return self.forward_with_aux(params, tokens, step, key)[0]

  def forward_with_aux(self, params, tokens: jax.Array, step, key
                       ) -> tuple[jax.Array, jax.Array]:
    """`(logits, auxiliary loss)`: the weighted mean of the load-balancing
    losses the model's mixture-of-experts layers sow (0 without any)."""
    with nvfp4_jax.precision_rules(self.rules, step=step), (
        nvfp4_jax.mesh_rules(self.mesh_rules) if self.mesh_rules
        else contextlib.nullcontext()):
      logits, state = self.model.apply({"params": params}, tokens,
                                       rngs={"nvfp4": key},
                                       mutable=["losses"])
    losses = jax.tree.leaves(state.get("losses", {}))
    if not losses:
      return logits, jnp.zeros((), jnp.float32)
    weight = getattr(getattr(self.model, "cfg", None), "aux_loss_weight", 0.0)
    return logits, weight * jnp.mean(jnp.stack(losses))

  def _like_params(self, tree):
    """`tree` (shaped like the parameters) kept sharded like them."""
    if self.mesh_rules is None:
      return tree
    specs = self.mesh_rules.param_specs(tree)
    return jax.lax.with_sharding_constraint(
        tree, self.mesh_rules.shardings(specs))

  def loss(self, params, batch: jax.Array, step, key) -> jax.Array:
    """Mean loss of `batch: int32 [batch, seq_len + 1]` (inputs, targets)."""
    logits, aux = self.forward_with_aux(params, batch[:, :-1], step, key)
    return cross_entropy(logits, batch[:, 1:]) + aux

  def init_state(self) -> TrainState:
    """The state before step 0 (same parameters for every precision)."""
    tokens = jnp.zeros((1, self.cfg.seq_len), jnp.int32)
    with nvfp4_jax.precision_rules(nvfp4_jax.PrecisionRules.high_precision()):
      params = self.model.init(self._init_key, tokens)["params"]
    # Copies: for FP32 params the master would alias them, and the train
    # step donates the whole state.
    opt_state = jax.tree.map(jnp.copy, self.optimizer.init(params))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=opt_state,
                      skipped=jnp.zeros((), jnp.int32))

  def loss_and_grads(self, params, batch: jax.Array, step
                     ) -> tuple[jax.Array, Any]:
    """Mean loss and mean FP32 gradients over micro-batches.

    Args:
      params: the model's parameters.
      batch: int32 `[grad_accum, micro_batch, seq_len + 1]`.
      step: the step (traced or concrete): selects the late switch and seeds
        the stochastic rounding of micro-batch `i` with
        `fold_in(fold_in(sr_key, step), i)`.

    Returns:
      `(loss, grads)`: the mean over micro-batches of each one's mean loss
      (FP32 scalar) and of its gradients (FP32, shaped like `params`).
    """
    key = jax.random.fold_in(self._sr_key, step)
    grad_fn = jax.value_and_grad(self.loss)

    def micro(carry, xs):
      i, mb = xs
      loss, grads = grad_fn(params, mb, step, jax.random.fold_in(key, i))
      grads = self._like_params(
          jax.tree.map(lambda g: g.astype(jnp.float32), grads))
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), self._like_params(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))
    n = batch.shape[0]
    (loss, grads), _ = jax.lax.scan(micro, zeros, (jnp.arange(n), batch))
    return loss / n, jax.tree.map(lambda g: g / n, grads)

  def train_step(self, state: TrainState, batch: jax.Array
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on `batch: int32 [grad_accum, micro, seq_len + 1]`.

    Returns:
      The new state and the step's metrics: `loss`, `grad_norm` (before
      clipping), `lr` and `finite` (False: the step was skipped).
    """
    step = state.step
    loss, grads = self.loss_and_grads(state.params, batch, step)
    finite = jnp.isfinite(loss) & _all_finite(grads)

    updates, opt_state = self.optimizer.update(grads, state.opt_state,
                                               state.params)
    # A select per element, fused into the update (as `optax.apply_if_finite`
    # does), not a `lax.cond`: XLA keeps a second copy of the whole state
    # for a `cond`'s branches (compiled for 4 H100s, a 4096 x 32 GPT's
    # FSDP step: 48.4 -> 30.9 GiB a device), and XLA:GPU's conditional
    # thunk may wait on the host for its predicate every step.
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, optax.apply_updates(state.params, updates),
                          state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    new = TrainState(step=step + 1, params=params, opt_state=opt_state,
                     skipped=state.skipped + (~finite).astype(jnp.int32))
    # The optimizer's count excludes skipped steps, and so does the schedule.
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
               "lr": self.schedule(step - state.skipped), "finite": finite}
    return new, metrics

  def evaluate(self, params, batches: jax.Array, step):
    """Validation loss (and diagnostics) over `batches: [n, micro, seq+1]`.

    Returns:
      `(mean loss, {layer path: {stat: mean over batches}})`; the dict is
      empty when `cfg.diagnostics` is off.
    """
    def forward(p, tokens):
      return self.forward(p, tokens, step, self._eval_key)
    fn = with_diagnostics(forward) if self.cfg.diagnostics else (
        lambda p, tokens: (forward(p, tokens), {}))

    def body(carry, mb):
      logits, stats = fn(params, mb[:, :-1])
      return jax.tree.map(jnp.add, carry,
                          (cross_entropy(logits, mb[:, 1:]), stats)), None
    zeros = jax.eval_shape(fn, params, batches[0, :, :-1])[1]
    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros))
    total, _ = jax.lax.scan(body, zeros, batches)
    return jax.tree.map(lambda t: t / batches.shape[0], total)
