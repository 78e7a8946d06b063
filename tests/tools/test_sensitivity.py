"""Layer sensitivity analysis -> suggested precision rules (issue 13)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import nvfp4_jax as nv
from nvfp4_jax.tools import sensitivity as sn


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.gelu(nv.NVFP4Dense(64, name=f"fc{i}")(x))
    return nv.NVFP4Dense(16, name="out")(x)


def _setup():
  model = MLP()
  x = jax.random.normal(jax.random.key(0), (64, 64))
  y = jax.random.randint(jax.random.key(1), (64,), 0, 16)
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    params = model.init(jax.random.key(2), x)
  # fc2's weight gets one 16x outlier in every 16x16 tile: the tile's scale
  # is set by it and the ordinary values lose most of their FP4 grid (a much
  # larger outlier would dominate the output and hide its own damage).
  k = np.array(params["params"]["fc2"]["kernel"])
  k[::16, ::16] *= 16.0
  params["params"]["fc2"]["kernel"] = jnp.asarray(k)

  def loss(p, batch):
    xb, yb = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, xb), yb).mean()
  return model, params, loss, [(x, y)]


def test_outlier_layer_is_flagged_and_kept_in_bf16():
  model, params, loss, batches = _setup()
  res = sn.analyze(loss, params, batches)
  assert [r.path for r in res] == ["fc0", "fc1", "fc2", "fc3", "out"]
  ranked = sorted(res, key=lambda r: -r.score())
  assert ranked[0].path == "fc2"
  fc2 = {r.path: r for r in res}["fc2"]
  others = [r for r in res if r.path != "fc2"]
  assert fc2.stats["fprop_err"] > 1.5 * max(r.stats["fprop_err"]
                                             for r in others)
  assert fc2.stats["w_flushed"] > 2 * max(r.stats["w_flushed"]
                                          for r in others)
  rules = sn.suggest_rules(res, budget=0.2)  # 1 of 5 layers.
  assert rules.recipe_for("fc2") == nv.Recipe.bf16()
  assert all(rules.recipe_for(p).quantized for p in ("fc0", "fc1", "fc3",
                                                     "out"))
  assert "fc2" in sn.table(res).splitlines()[1]


def test_suggested_rules_load_and_train():
  model, params, loss, batches = _setup()
  rules = sn.suggest_rules(sn.analyze(loss, params, batches), budget=0.2)
  rules.resolve(params)  # Every rule matches a layer.
  tx = nv.master_weights(optax.adam(3e-3))
  opt = tx.init(params)

  @jax.jit
  def step(p, opt, i):
    def f(p):
      with nv.precision_rules(rules, step=i):
        return loss(p, batches[0])
    value, g = jax.value_and_grad(f)(p)
    u, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, u), opt, value
  losses = []
  for i in range(8):
    params, opt, value = step(params, opt, jnp.int32(i))
    losses.append(float(value))
  assert losses[-1] < losses[0], losses
  report = nv.report(lambda p: jax.grad(
      lambda p: _loss_under(rules, loss, p, batches[0]))(p), params)
  assert {g.layer for g in report.quantized} == {"fc0", "fc1", "fc3", "out"}


def _loss_under(rules, loss, p, batch):
  with nv.precision_rules(rules, step=0):
    return loss(p, batch)
