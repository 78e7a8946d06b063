"""`nvfp4_jax.report`: which GEMMs ran quantized, read from the traced program."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import nvfp4_jax as nv


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nv.NVFP4Dense(64, name="up")(x)
    x = nv.NVFP4Dense(64, name="mid")(nn.relu(x))
    x = nv.NVFP4Dense(32, name="down")(nn.relu(x))
    return nn.Dense(8, name="head")(x)  # A plain flax layer.


X = jnp.ones((40, 32))  # 40 tokens: the Wgrad operands are padded inside.


def _step(rules, step=0):
  net = Net()
  params = net.init(jax.random.key(0), X)

  def grad(p, x, s):
    def loss(p):
      with nv.precision_rules(rules, step=s):
        return net.apply(p, x, rngs={"nvfp4": jax.random.key(1)}).sum()
    return jax.grad(loss)(p)
  return grad, (params, X, jnp.int32(step))


def test_counts_each_gemm_kind_with_layer_recipe_and_implementation():
  rules = nv.PrecisionRules(rules=(("mid", nv.Recipe.bf16()),))
  fn, args = _step(rules)
  r = nv.report(fn, *args)
  q = {(g.layer, g.gemm): g for g in r.quantized}
  assert sorted(q) == sorted((layer, gemm) for layer in ("up", "down")
                             for gemm in ("fprop", "dgrad", "wgrad"))
  assert q[("up", "fprop")].precision == "nvfp4,nvfp4-16x16"
  assert q[("up", "dgrad")].precision == "nvfp4-sr,nvfp4-16x16"
  assert q[("up", "wgrad")].precision == "nvfp4-sr-rht16,nvfp4-rht16"
  assert all(g.implementation.startswith("emulation") for g in r.quantized)
  assert all(g.quantizers for g in r.quantized)
  reasons = {}
  for g in r.high_precision:
    reasons.setdefault(g.reason, set()).add(g.layer)
  assert reasons == {"recipe: bf16": {"mid"}, "not an NVFP4 layer": {""}}
  assert r.count("fprop") == r.count("dgrad") == r.count("wgrad") == 2
  assert "6 GEMMs quantized" in r.summary() and "recipe: bf16" in str(r)


def test_nothing_quantized_when_rules_say_bf16():
  fn, args = _step(nv.PrecisionRules.high_precision())
  r = nv.report(fn, *args)
  assert not r.quantized
  assert {g.layer for g in r.high_precision} == {"up", "mid", "down", ""}


def test_kernels_named_when_they_run():
  fn, args = _step(nv.PrecisionRules())
  with nv.default_implementation("pallas"):  # Interpreted on CPU.
    r = nv.report(fn, *args)
  g = {(g.layer, g.gemm): g for g in r.quantized}[("up", "wgrad")]
  assert "nvfp4_block_values" in g.implementation
  assert "nvfp4_quantize_x_and_rht_t" in g.quantizers
  with nv.default_implementation("xla"):
    r = nv.report(fn, *args)
  assert all("pallas" not in g.implementation + g.quantizers
             for g in r.quantized)


@pytest.mark.parametrize("mode,fprop_after", [("all", "bf16"),
                                              ("forward", "bf16")])
def test_late_switch_lists_both_branches(mode, fprop_after):
  rules = nv.PrecisionRules(late_switch=nv.LateSwitch(step=5, mode=mode))
  fn, args = _step(rules)
  r = nv.report(fn, *args)
  up = [g for g in r.gemms if g.layer == "up"]
  branches = {g.branch for g in up}
  assert branches == {"cond 1/2", "cond 2/2"}
  before = {g.gemm: g.precision for g in up if g.branch == "cond 1/2"}
  after = {g.gemm: g.precision for g in up if g.branch == "cond 2/2"}
  assert before["fprop"].startswith("nvfp4") and after["fprop"] == fprop_after
  # The forward-only switch keeps the backward GEMMs quantized.
  assert (after.get("dgrad", "bf16") != "bf16") == (mode == "forward")
