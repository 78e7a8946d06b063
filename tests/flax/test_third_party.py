"""Third-party flax models run unmodified on NVFP4 (issue 14, item 2).

Two published models nobody here wrote, vendored byte for byte under
`tests/support/third_party/` (see its README):
google-research/vision_transformer's linen `VisionTransformer` and flax's NNX
`TransformerLM` (examples/lm1b_nnx).
Each is switched with one call, keeps its parameter tree, trains through the
FP32 master weights, and the traced step shows which GEMMs quantized.
"""

import hashlib
import importlib.util
import pathlib
import re
import sys
import types
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax as nv

THIRD = pathlib.Path(__file__).resolve().parents[1] / "support" / "third_party"
VIT_DIR = THIRD / "vision_transformer"
LM1B_DIR = THIRD / "flax_lm1b_nnx"
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

# sha256 of the upstream files at the commits named in third_party/README.md.
VENDORED = {
    "vision_transformer/LICENSE":
        "4bebd04f269afe8437d003b4254204bd841dcb8106b96cb72158803ff9d711c2",
    "vision_transformer/vit_jax/__init__.py":
        "e87a69aca53314bbd8e371fff08192a4adad73a9ab0ca5d814f1c1c190e3247e",
    "vision_transformer/vit_jax/models_vit.py":
        "5eab3bf5ef2cbe6e5543cc57d26808ce7ed68592abbe9a683f1c2784d2bdc5e6",
    "vision_transformer/vit_jax/models_resnet.py":
        "7d27475672828c63b4a1270fb9a295c30d996ca19479a74fb739ae5a01b79440",
    "flax_lm1b_nnx/LICENSE":
        "25e8791da26f7e74c4baf19eafd7d137b64a46952ef840ed01c172b680cf4046",
    "flax_lm1b_nnx/models.py":
        "3614455c6ebe8f7ca9dd4cc82dfc2f45c147b5541b1a7995db9db7a7b3c59491",
    "flax_lm1b_nnx/configs/default.py":
        "ae9f33b136b86b858aff6f4ce7b7257ada8d93a783b13eb16260ae30bdb8cc9d",
}

def _import_vendored(directory, name, path=None):
  """Imports module `name` (from `directory/path` if given) with `directory`
  on sys.path only while it runs, for its own imports (`vit_jax.
  models_resnet`, `configs.default`): the lm1b directory holds a `models.py`
  that must not shadow the project's `models` package."""
  sys.path.insert(0, str(directory))
  try:
    if path is None:
      return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, directory / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
  finally:
    sys.path.remove(str(directory))


models_vit = _import_vendored(VIT_DIR, "vit_jax.models_vit")
lm1b = _import_vendored(LM1B_DIR, "lm1b_nnx_models", "models.py")

# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def _shapes(tree):
  return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


def _regions(jaxpr, found=None):
  """{region name: [eqn]} of the named GEMM regions anywhere in `jaxpr`."""
  found = {} if found is None else found
  for eqn in jaxpr.eqns:
    name = str(eqn.params.get("name", ""))
    if re.fullmatch(r"(nvfp4|bf16)_(fprop|dgrad|wgrad)", name):
      found.setdefault(name, []).append(eqn)
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          _regions(inner, found)
  return found


def _check_quantized_regions(fn, *args, per_kind):
  """Each quantized GEMM kind appears `per_kind` times and multiplies FP4
  codes with E4M3 scales (Dgrad's saved weight, Wgrad's saved q(rht(X^T)))
  or, in Fprop where the GEMM is the exact emulation, only the block values
  (bf16) and amaxes (FP32) the quantizers of X and W wrote; returns the
  report."""
  regions = _regions(jax.make_jaxpr(fn)(*args).jaxpr)
  for kind in ("fprop", "dgrad", "wgrad"):
    eqns = regions.get(f"nvfp4_{kind}", [])
    assert len(eqns) == per_kind, (kind, len(eqns))
    for eqn in eqns:
      dtypes = {str(v.aval.dtype) for v in eqn.invars}
      if kind == "fprop" and nv.ops.block_scaled_matmul.api.consumes_values():
        assert dtypes == {"bfloat16", "float32"}, (kind, dtypes)
      else:
        assert {"uint8", "float8_e4m3fn"} <= dtypes, (kind, dtypes)
  return nv.report(fn, *args)


# ---------------------------------------------------------------------------
# Provenance.
# ---------------------------------------------------------------------------


def test_vendored_models_are_the_published_files():
  for rel, digest in VENDORED.items():
    data = (THIRD / rel).read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest, rel
  for license_file in ("vision_transformer/LICENSE", "flax_lm1b_nnx/LICENSE"):
    assert "Apache License" in (THIRD / license_file).read_text()


# ---------------------------------------------------------------------------
# Linen: the Vision Transformer.
# ---------------------------------------------------------------------------

VIT = dict(
    num_classes=10, hidden_size=32, classifier="token",
    patches=types.SimpleNamespace(size=(4, 4)),
    transformer=dict(num_layers=3, mlp_dim=64, num_heads=2, dropout_rate=0.0,
                     attention_dropout_rate=0.0))
IMAGES = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))  # 17 tokens each.
LABELS = jnp.arange(4) % 10
# The paper preset in the ViT's own block names: blocks 0 and 2 in BF16.
VIT_RULES = nv.paper_rules(3, first=1, last_fraction=1 / 3,
                           block_name="encoderblock_{}")
VIT_LAYERS = [f"Transformer/encoderblock_{{}}/{m}" for m in (
    "MlpBlock_0/Dense_0", "MlpBlock_0/Dense_1",
    "MultiHeadDotProductAttention_0/key", "MultiHeadDotProductAttention_0/out",
    "MultiHeadDotProductAttention_0/query",
    "MultiHeadDotProductAttention_0/value")]


def _vit(num_layers=3):
  cfg = dict(VIT, transformer=dict(VIT["transformer"], num_layers=num_layers))
  model = models_vit.VisionTransformer(**cfg)
  return model, jax.jit(lambda k: model.init(k, IMAGES, train=False))(
      jax.random.key(1))


def _swapped_vit_module(monkeypatch):
  """models_vit.py as a user edits it: `nn.Dense(` -> `NVFP4Dense(`."""
  src = (VIT_DIR / "vit_jax" / "models_vit.py").read_text()
  assert src.count("nn.Dense(") == 4  # The MLP's two, pre_logits, the head.
  src = "import nvfp4_jax\n" + src.replace("nn.Dense(", "nvfp4_jax.NVFP4Dense(")
  module = types.ModuleType("models_vit_nvfp4")
  monkeypatch.setitem(sys.modules, module.__name__, module)
  exec(compile(src, "models_vit.py (nn.Dense -> NVFP4Dense)", "exec"),  # pylint: disable=exec-used
       module.__dict__)
  return module


def test_class_swap_keeps_auto_names_so_checkpoints_load(monkeypatch):
  model, params = _vit(num_layers=2)
  swapped = _swapped_vit_module(monkeypatch).VisionTransformer(**dict(
      VIT, transformer=dict(VIT["transformer"], num_layers=2)))
  head_bf16 = nv.PrecisionRules(rules=((r"^head$", nv.Recipe.bf16()),))
  with nv.precision_rules(head_bf16):
    new = jax.eval_shape(lambda: swapped.init(jax.random.key(1), IMAGES,
                                              train=False))
    paths = nv.nvfp4_layer_paths(swapped, IMAGES, train=False)
  assert _shapes(new) == _shapes(params)  # Dense_0, Dense_1: same names.
  assert "Dense_0" in params["params"]["Transformer"]["encoderblock_0"][
      "MlpBlock_0"]
  assert paths == sorted(["head"] + [
      f"Transformer/encoderblock_{i}/MlpBlock_0/Dense_{j}"
      for i in range(2) for j in range(2)])
  assert repr(nv.NVFP4Dense).endswith("NVFP4Dense'>")
  # The pretrained checkpoint loads; in high precision it is the same model.
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    y = jax.jit(lambda p: swapped.apply(p, IMAGES, train=False))(params)
  np.testing.assert_array_equal(
      y, jax.jit(lambda p: model.apply(p, IMAGES, train=False))(params))
  # With the default rules its MLPs quantize (the forward pass: 2 blocks x 2).
  def fwd(p):
    with nv.precision_rules(head_bf16):
      return swapped.apply(p, IMAGES, train=False)
  assert nv.report(fwd, params).count("fprop") == 4


def test_inject_linen_in_high_precision_is_exactly_the_model():
  model, params = _vit(num_layers=1)

  def loss(p, inject):
    if not inject:
      return jnp.sum(model.apply(p, IMAGES, train=False) ** 2)
    with nv.inject_linen(nv.PrecisionRules.high_precision()):
      return jnp.sum(model.apply(p, IMAGES, train=False) ** 2)
  ref = jax.jit(jax.value_and_grad(lambda p: loss(p, False)))(params)
  got = jax.jit(jax.value_and_grad(lambda p: loss(p, True)))(params)
  jax.tree.map(np.testing.assert_array_equal, got, ref)


def test_linen_head_that_cannot_quantize_is_named_once():
  model, params = _vit()
  with pytest.raises(ValueError, match=r"'head'.*in=32, out=10.*"
                     r"unsupported='high_precision'"):
    with nv.inject_linen():
      jax.eval_shape(lambda: model.apply(params, IMAGES, train=False))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with nv.inject_linen(VIT_RULES, unsupported="high_precision"):
      new = jax.eval_shape(lambda: model.init(jax.random.key(1), IMAGES,
                                              train=False))
      paths = nv.nvfp4_layer_paths(model, IMAGES, train=False)
  assert _shapes(new) == _shapes(params)
  # One warning for the block, though two traces (init, paths) met the head.
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert "'head'" in str(caught[0].message)
  # The summary lists only what the library runs: no head, no patch conv.
  assert paths == sorted(p.format(i) for p in VIT_LAYERS for i in range(3))
  table = VIT_RULES.summary(params, layer_paths=paths)
  assert "head" not in table and "embedding" not in table
  assert len(re.findall(r"encoderblock_1/\S+\s+nvfp4$", table, re.M)) == 6
  assert len(re.findall(r"\s+bf16$", table, re.M)) == 12
  # Without traced paths the guess still never counts the convolution.
  assert "embedding" not in VIT_RULES.summary(params, strict=False)


def _readme_block(marker):
  # The recipes are on the docs' layers page; README repeats the linen one.
  text = README.read_text() + (README.parent / "docs" / "layers.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  found = {b for b in blocks if marker in b}
  assert len(found) == 1, marker
  return compile(found.pop(), "README.md", "exec")


def _expected(rules, layers, num_blocks):
  """(quantized, bf16) layer paths that `rules` give the model's blocks."""
  paths = {p.format(i) for p in layers for i in range(num_blocks)}
  quantized = {p for p in paths if rules.recipe_for(p).quantized}
  return quantized, paths - quantized


def test_vit_trains_with_the_readme_recipe_and_paper_preset():
  """README's linen recipe, as written, on the unmodified ViT."""
  model, _ = _vit()
  ns = {"model": model, "x": IMAGES, "y": LABELS}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # The head; tested above.
    exec(_readme_block("inject_linen("), ns)  # pylint: disable=exec-used
    params, opt_state, train_step = ns["params"], ns["opt_state"], \
        ns["train_step"]
    quantized, bf16 = _expected(ns["rules"], VIT_LAYERS, 3)
    assert len(quantized) == 6 and len(bf16) == 12  # Block 2 of 0-2.
    report = _check_quantized_regions(train_step, params, opt_state, IMAGES,
                                      LABELS, jnp.int32(0), per_kind=6)
    losses = []
    for step in range(5):
      params, opt_state, loss = train_step(params, opt_state, IMAGES, LABELS,
                                           jnp.int32(step))
      losses.append(float(loss))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
  # The paper preset: each of the quantized block's six linear layers in all
  # three GEMMs; the other blocks' in BF16 by rule, the head by its shape.
  for kind in ("fprop", "dgrad", "wgrad"):
    assert {g.layer for g in report.quantized if g.gemm == kind} == quantized
  hp = report.high_precision
  assert {g.layer for g in hp if g.reason == "recipe: bf16"} == bf16
  assert sum(g.reason == "not an NVFP4 layer" for g in hp) == 3  # The head.
  assert sum(g.reason == "batched GEMM (attention)" for g in hp) == 3 * 6
  master = nv.master_params(opt_state)  # FP32 master weights.
  assert {a.dtype for a in jax.tree.leaves(master)} == {jnp.dtype("float32")}


def test_linen_einsum_and_dense_general_are_switched():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral((2, 16), name="proj")(x)            # [b, t, 2, 16]
      h = nn.Einsum((2, 16, 32), "bthd,hdo->bto", name="mix")(h)
      return nn.Einsum((32, 48), "bti,io->bot", name="swapped")(h)
  net = Net()
  x = jax.random.normal(jax.random.key(0), (2, 16, 32))
  params = net.init(jax.random.key(1), x)
  with nv.inject_linen():
    assert _shapes(net.init(jax.random.key(1), x)) == _shapes(params)
    paths = nv.nvfp4_layer_paths(net, x)
  assert paths == ["mix", "proj", "swapped"]

  def loss(p, step):
    with nv.inject_linen(step=step):
      return jnp.sum(net.apply(p, x) ** 2)
  _check_quantized_regions(jax.grad(loss), params, jnp.int32(0), per_kind=3)
  def forward(p, rules):
    with nv.inject_linen(rules, step=0):
      return net.apply(p, x)
  ref = jax.jit(net.apply)(params, x)
  np.testing.assert_allclose(
      jax.jit(forward, static_argnums=1)(params,
                                         nv.PrecisionRules.high_precision()),
      ref, rtol=1e-5, atol=1e-5)
  y = jax.jit(forward, static_argnums=1)(params, nv.PrecisionRules())
  assert y.shape == ref.shape == (2, 48, 16)
  # Three quantized layers in a row: close, not equal.
  assert 0.02 < float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.4


def test_sr_keys_differ_per_layer_and_per_step():
  ones = lambda key, shape, dtype: jnp.full(shape, 0.1, dtype)

  class Twins(nn.Module):  # Two identical layers on the same input.
    @nn.compact
    def __call__(self, x):
      return (nn.Dense(32, kernel_init=ones)(x)
              + nn.Dense(32, kernel_init=ones)(x))
  net = Twins()
  x = jax.random.normal(jax.random.key(0), (32, 32))
  params = net.init(jax.random.key(1), x)

  @jax.jit
  def grads(p, step):
    def loss(p):
      with nv.inject_linen(step=step):
        return jnp.sum(jnp.sin(net.apply(p, x)))
    g = jax.grad(loss)(p)["params"]
    return g["Dense_0"]["kernel"], g["Dense_1"]["kernel"]
  a0, b0 = grads(params, 0)
  a0_again, _ = grads(params, 0)
  a1, _ = grads(params, 1)
  np.testing.assert_array_equal(a0, a0_again)
  assert np.any(np.asarray(a0 != b0))   # Per layer.
  assert np.any(np.asarray(a0 != a1))   # Per step.
  # Without a step or an "nvfp4" stream the backward pass says what to pass.
  def no_key(p):
    with nv.inject_linen():
      return jnp.sum(net.apply(p, x))
  with pytest.raises(ValueError, match=r"'Dense_\d'.*no key.*step=step"):
    jax.eval_shape(jax.grad(no_key), params)


# ---------------------------------------------------------------------------
# NNX: flax's lm1b decoder-only Transformer.
# ---------------------------------------------------------------------------

LM_CFG = dict(vocab_size=100, output_vocab_size=100, emb_dim=32, num_heads=2,
              num_layers=3, qkv_dim=32, mlp_dim=64, max_len=64,
              dropout_rate=0.0, attention_dropout_rate=0.0)
TOKENS = jax.random.randint(jax.random.key(0), (4, 24), 1, 100)
LM_RULES = nv.paper_rules(3, first=1, last_fraction=1 / 3,
                          block_name="encoderdecoderblock_{}")
LM_LAYERS = [f"decoder/encoderdecoderblock_{{}}/{m}" for m in (
    "attention/key", "attention/out", "attention/query", "attention/value",
    "mlp/linear1", "mlp/linear2")]


@pytest.fixture
def lm():
  # Its parameters carry sharding annotations: flax builds them in a mesh.
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):
    model = lm1b.TransformerLM(lm1b.TransformerConfig(**LM_CFG),
                               rngs=nnx.Rngs(0))
    model.set_attributes(deterministic=False, decode=False)  # As its train.py.
    yield model


def test_nnx_lm_trains_with_the_readme_recipe_and_paper_preset(lm):
  """README's NNX recipe, as written, on the unmodified lm1b TransformerLM."""
  before = nnx.state(lm)
  ns = {"model": lm, "x": TOKENS, "y": TOKENS}
  with pytest.warns(UserWarning, match=r"'decoder/logitdense'.*out=100"):
    exec(_readme_block("inject_nnx("), ns)  # pylint: disable=exec-used
  after = nnx.state(lm)
  assert jax.tree.structure(after) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  rules, optimizer, train_step = ns["rules"], ns["optimizer"], ns["train_step"]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    switched = nv.inject_nnx(lm, rules, unsupported="high_precision")  # Again.
  quantized, bf16 = _expected(rules, LM_LAYERS, 3)
  assert len(quantized) == 6 and len(bf16) == 12
  assert set(switched) == quantized | bf16
  table = rules.summary(nnx.state(lm, nnx.Param), layer_paths=switched)
  assert "logitdense" not in table and "embed" not in table
  assert len(re.findall(r"\s+nvfp4$", table, re.M)) == 6

  report = _check_quantized_regions(train_step, lm, optimizer, TOKENS, TOKENS,
                                    jnp.int32(0), per_kind=6)
  losses = [float(train_step(lm, optimizer, TOKENS, TOKENS, jnp.int32(s)))
            for s in range(5)]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
  for kind in ("fprop", "dgrad", "wgrad"):
    assert {g.layer for g in report.quantized if g.gemm == kind} == quantized
  hp = report.high_precision
  assert {g.layer for g in hp if g.reason == "recipe: bf16"} == bf16
  assert sum(g.reason == "not an NVFP4 layer" for g in hp) == 3  # logitdense.
  master = nv.master_params(optimizer.opt_state)
  assert {a.dtype for a in jax.tree.leaves(master)} == {jnp.dtype("float32")}
  # Training changed values only: the state is still the model's own tree.
  assert jax.tree.structure(nnx.state(lm)) == jax.tree.structure(before)


def test_nnx_misuse_and_unsupported_layers_are_named(lm):
  before = nnx.state(lm)
  with pytest.raises(ValueError, match=r"'decoder/logitdense'.*out=100.*"
                     r"unsupported='high_precision'"):
    nv.inject_nnx(lm, LM_RULES)
  assert lm.decoder.logitdense.dot_general is jax.lax.dot_general  # Untouched.
  jax.tree.map(np.testing.assert_array_equal, nnx.state(lm), before)
  with pytest.raises(ValueError, match=r"matched no layer.*encoderblock"):
    nv.inject_nnx(lm, nv.paper_rules(3, block_name="encoderblock_{}"),
                  unsupported="high_precision")
  layer = nnx.Linear(32, 32, dot_general=nv.NVFP4DotGeneral(), rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"linen module.*inject_nnx"):
    layer(jnp.ones((16, 32)))


def test_nvfp4_linear_is_nnx_linear_twin():
  kwargs = dict(use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32,
                precision=None, kernel_init=nnx.initializers.lecun_normal(),
                bias_init=nnx.initializers.zeros_init(),
                promote_dtype=nnx.nn.dtypes.promote_dtype,
                preferred_element_type=jnp.float32,
                kernel_metadata={"sharding_names": None}, bias_metadata={})
  ref = nnx.Linear(32, 48, rngs=nnx.Rngs(0), **kwargs)
  lin = nv.NVFP4Linear(32, 48, rngs=nnx.Rngs(0), recipe=nv.Recipe.bf16(),
                       dot_general=None, **kwargs)
  assert isinstance(lin, nnx.Linear)
  assert jax.tree.structure(nnx.state(lin)) == jax.tree.structure(
      nnx.state(ref))
  x = jax.random.normal(jax.random.key(0), (16, 32))
  np.testing.assert_array_equal(lin(x, out_sharding=None), ref(x))
  with pytest.raises(ValueError, match="Use nnx.Linear for a custom"):
    nv.NVFP4Linear(32, 48, dot_general=lambda *a, **k: None, rngs=nnx.Rngs(0))


def test_nnx_einsum_linear_general_and_per_layer_keys():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.proj = nnx.LinearGeneral(32, (2, 16), rngs=rngs)
      self.mix = nnx.Einsum("bthd,hdo->bto", (2, 16, 32), (32,), rngs=rngs)
      same = lambda key, shape, dtype: jnp.full(shape, 0.1, dtype)
      self.twins = nnx.List([nnx.Linear(32, 32, kernel_init=same, rngs=rngs)
                             for _ in range(2)])

    def __call__(self, x):
      h = self.mix(self.proj(x))
      return self.twins[0](h) + self.twins[1](h)
  net = Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 16, 32))
  forward = nnx.jit(lambda net: net(x))
  ref = forward(net)
  nv.inject_nnx(net, nv.PrecisionRules.high_precision())
  np.testing.assert_allclose(forward(net), ref, rtol=1e-5, atol=1e-5)
  switched = nv.inject_nnx(net)  # Switching again replaces the rules.
  assert sorted(switched) == ["mix", "proj", "twins/0", "twins/1"]
  y = forward(net)
  # Three quantized layers in a row: close, not equal.
  assert 0.02 < float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.4

  @nnx.jit
  def grads(net, step):
    with nv.precision_rules(nv.PrecisionRules(), step=step):
      return nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(net)
  _check_quantized_regions(grads, net, jnp.int32(0), per_kind=4)
  g0, g0_again, g1 = (grads(net, jnp.int32(s)) for s in (0, 0, 1))
  k = lambda g, i: np.asarray(g["twins"][i]["kernel"][...])
  np.testing.assert_array_equal(k(g0, 0), k(g0_again, 0))
  assert np.any(k(g0, 0) != k(g0, 1))   # Per layer.
  assert np.any(k(g0, 0) != k(g1, 0))   # Per step.
  with pytest.raises(ValueError, match=r"no key.*step=step"):
    nnx.jit(nnx.grad(lambda m: jnp.sum(m(x))))(net)  # No step in scope.
