"""Per-layer precision rules, the paper preset and the late switch (issue 3)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax as nv

D = 32


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name="norm")(x)
    q = nv.NVFP4Dense(D, use_bias=False, name="q")(h)
    x = x + nv.NVFP4Dense(D, use_bias=False, name="o")(q)
    return x + nv.NVFP4Dense(D, use_bias=False, name="mlp")(x)


class TinyLM(nn.Module):
  num_blocks: int = 6

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="embed")(x)
    for i in range(self.num_blocks):
      x = Block(name=f"block_{i}")(x)
    return nn.Dense(8, name="head")(x)


@pytest.fixture(scope="module")
def model_and_params():
  m = TinyLM()
  x = jnp.ones((16, D))
  return m, jax.jit(m.init)(jax.random.key(0), x), x


@pytest.fixture(scope="module")
def four_blocks():
  """A 4-block `TinyLM`, for the tests that compile its gradient: the paper
  rules still quantize a block (`block_2`) and keep the first two and the
  last in BF16, at two thirds of the 6-block model's compile time."""
  m = TinyLM(num_blocks=4)
  x = jnp.ones((16, D))
  return m, jax.jit(m.init)(jax.random.key(0), x), x


def test_resolve_first_match_wins(model_and_params):
  m, params, x = model_and_params
  rules = nv.PrecisionRules(
      rules=((r"block_0/", nv.Recipe.bf16()),
             (r"/mlp$", nv.Recipe.mxfp8()),
             (r"block_0/mlp", nv.Recipe.mxfp4())),  # Shadowed by rule 0.
      default=nv.Recipe.nvfp4())
  paths = nv.nvfp4_layer_paths(m, x)
  assert "head" not in paths and "embed" not in paths
  assert len(paths) == 18
  with pytest.raises(ValueError, match=r"matched no layer.*block_0/mlp"):
    rules.resolve(params, layer_paths=paths)
  tree = rules.resolve(params, layer_paths=paths, strict=False)
  p = params["params"]
  assert jax.tree.structure(tree, is_leaf=lambda v: v is None or
                            isinstance(v, nv.Recipe)) == jax.tree.structure(p)
  assert tree["block_0"]["mlp"]["kernel"] == nv.Recipe.bf16()
  assert tree["block_3"]["mlp"]["kernel"] == nv.Recipe.mxfp8()
  assert tree["block_3"]["q"]["kernel"] == nv.Recipe.nvfp4()
  assert tree["block_3"]["norm"]["scale"] is None
  assert tree["head"]["kernel"] is None and tree["embed"]["kernel"] is None


def test_paper_rules(model_and_params):
  m, params, x = model_and_params
  rules = nv.paper_rules(6, first=2, last_fraction=0.15)
  paths = nv.nvfp4_layer_paths(m, x)
  tree = rules.resolve(params, layer_paths=paths)
  fmt = {i: tree[f"block_{i}"]["q"]["kernel"].name for i in range(6)}
  assert fmt == {0: "bf16", 1: "bf16", 2: "nvfp4", 3: "nvfp4", 4: "nvfp4",
                 5: "bf16"}
  # The paper's 62-block model: 2 first + 10 last (ceil(0.15 * 62)).
  big = nv.paper_rules(62)
  hp = [i for i in range(62) if big.match(f"block_{i}/mlp") is not None]
  assert hp == [0, 1] + list(range(52, 62))
  assert big.match("block_1x/mlp") is None  # Whole names only.
  assert "block_2" in rules.summary(params, layer_paths=paths)


def test_rules_validation():
  with pytest.raises(TypeError, match="not a Recipe"):
    nv.PrecisionRules(rules=(("x", "bf16"),))
  with pytest.raises(ValueError, match="bad rule pattern"):
    nv.PrecisionRules(rules=(("(", nv.Recipe.bf16()),))
  with pytest.raises(ValueError, match="unknown LateSwitch mode"):
    nv.LateSwitch(step=3, mode="backward")


def test_rules_reach_the_layers(model_and_params):
  m, params, x = model_and_params
  def apply(rules):
    def f(p):
      with nv.precision_rules(rules):
        return m.apply(p, x)
    return jax.jit(f)(params)
  y_bf16 = apply(nv.PrecisionRules(default=nv.Recipe.bf16()))
  y_q = apply(nv.PrecisionRules())
  assert not np.allclose(y_bf16, y_q)
  # All-bf16 rules make every NVFP4Dense exactly nn.Dense.
  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(D, name="embed")(x)
      for i in range(6):
        h = nn.RMSNorm(name=f"block_{i}_norm")(x)
        q = nn.Dense(D, use_bias=False)(h)
        x = x + nn.Dense(D, use_bias=False)(q)
        x = x + nn.Dense(D, use_bias=False)(x)
      return nn.Dense(8, name="head")(x)
  p = params["params"]
  flat = {"embed": p["embed"], "head": p["head"]}
  for i in range(6):
    b = p[f"block_{i}"]
    flat[f"block_{i}_norm"] = b["norm"]
    for j, name in enumerate(("q", "o", "mlp")):
      flat[f"Dense_{3 * i + j}"] = b[name]
  np.testing.assert_array_equal(
      jax.jit(Plain().apply)({"params": flat}, x), y_bf16)


# "forward" in the fast tier, "all" (the same mechanism, every GEMM) in the
# slow tier: the suite's time budget.
@pytest.mark.parametrize("mode", [pytest.param("all", marks=pytest.mark.slow),
                                  "forward"])
def test_late_switch_flips_at_step_without_recompiling(four_blocks, mode):
  m, params, x = four_blocks
  switch = nv.LateSwitch(step=5, mode=mode)
  rules = nv.paper_rules(4, late_switch=switch)

  def loss(p, step):
    with nv.precision_rules(rules, step=step):
      return jnp.mean(m.apply(p, x) ** 2)

  step_fn = jax.jit(jax.value_and_grad(loss))
  before = [step_fn(params, jnp.int32(s)) for s in (3, 4)]
  after = [step_fn(params, jnp.int32(s)) for s in (5, 9)]
  assert step_fn._cache_size() == 1

  def static(r, step=5):
    def f(p):
      with nv.precision_rules(r, step=step):
        return jnp.mean(m.apply(p, x) ** 2)
    return jax.jit(jax.value_and_grad(f))(params)
  quant = static(nv.paper_rules(4), step=3)
  switched = static(nv.paper_rules(4, recipe=switch.apply(nv.Recipe.nvfp4())))
  for (l, g) in before:
    np.testing.assert_allclose(l, quant[0], rtol=1e-6)
  for (l, g) in after:
    np.testing.assert_allclose(l, switched[0], rtol=1e-6)
  np.testing.assert_allclose(  # Step 5 on both sides: the same SR keys.
      np.asarray(after[0][1]["params"]["block_2"]["q"]["kernel"]),
      np.asarray(switched[1]["params"]["block_2"]["q"]["kernel"]),
      rtol=1e-5, atol=1e-7)
  assert not np.allclose(before[0][0], after[0][0])
  if mode == "forward":  # Backward stays quantized: its grads differ from bf16.
    bf16 = static(nv.PrecisionRules(default=nv.Recipe.bf16()))
    np.testing.assert_allclose(after[0][0], bf16[0], rtol=1e-6)
    g_q = after[0][1]["params"]["block_2"]["q"]["kernel"]
    g_hp = bf16[1]["params"]["block_2"]["q"]["kernel"]
    assert not np.allclose(g_q, g_hp, rtol=1e-3)


def test_late_switch_needs_step(model_and_params):
  m, params, x = model_and_params
  rules = nv.PrecisionRules(late_switch=nv.LateSwitch(step=1))
  with pytest.raises(ValueError, match="pass step="):
    with nv.precision_rules(rules):
      m.apply(params, x)


def test_step_seeds_sr_without_rng_stream(four_blocks):
  m, params, x = four_blocks

  def f(p, step):
    with nv.precision_rules(nv.PrecisionRules(), step=step):
      return jnp.mean(m.apply(p, x) ** 2)
  step_grads = jax.jit(jax.grad(f))  # The step traced: one compilation.
  grads = lambda step: step_grads(params, step)["params"]["block_3"]["q"][
      "kernel"]
  g0, g0b, g1 = grads(jnp.int32(0)), grads(jnp.int32(0)), grads(jnp.int32(1))
  np.testing.assert_array_equal(g0, g0b)
  assert np.any(np.asarray(g0 != g1))


def test_nnx_apply_rules():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nv.NVFP4Linear(D, D, rngs=rngs)
      self.down = nv.NVFP4Linear(D, D, rngs=rngs)

    def __call__(self, x):
      return self.down(self.up(x))

  net = Net(nnx.Rngs(0))
  resolved = nv.apply_rules(
      net, nv.PrecisionRules(rules=((r"^down$", nv.Recipe.bf16()),)))
  assert resolved == {"up": nv.Recipe.nvfp4(), "down": nv.Recipe.bf16()}
  assert net.down.recipe == nv.Recipe.bf16()
  with pytest.raises(ValueError, match="matched no layer"):
    nv.apply_rules(net, nv.PrecisionRules(rules=((r"nothing", nv.Recipe.bf16()),)))
