"""Issue 42: every bad input a new user tries is answered clearly, or is right.

One table per family (the layers and the optimizer, the configs, the rules
and meshes, the export files; the public ops' is in
`tests/ops/test_op_errors.py`): each case is a call, the
error type it must raise and fragments its message must hold, the offending
value and the fix. Inputs that are not errors (a preset's name as a recipe,
integer parameters in `master_weights`, no tokens) get their verified result
instead. The CLI's cases (reruns, damaged checkpoints) are in
`test_run_safety.py`.
"""

from __future__ import annotations

import contextlib
import io
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from error_tables import assert_error
from error_tables import table_params
from models import GPTConfig
from nvfp4_jax import export
from nvfp4_jax.tools import safetensors
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.core.recipe import Recipe
from train import export as export_cli
from train.config import TrainConfig

X = jax.random.normal(jax.random.key(0), (32, 64))
W = jax.random.normal(jax.random.key(1), (64, 32))
DN = (((1,), (0,)), ((), ()))
KEY = jax.random.key(2)
BF16 = Recipe.bf16()


def _mesh():
  return nv.sharding.make_mesh()


# --- Layers and the optimizer -------------------------------------------------


def _dense(recipe):
  return nv.NVFP4Dense(32, recipe=recipe).init(KEY, X)


def _master_update(params, grads):
  tx = nv.master_weights(optax.sgd(0.5))
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


LAYERS = {
    "NVFP4Dense recipe an unknown preset": (
        lambda: _dense("fp8"), ValueError,
        ["recipe='fp8'", "'nvfp4'", "'bf16'", "Recipe.nvfp4(rht=False)"]),
    "NVFP4Dense recipe an int": (
        lambda: _dense(4), TypeError, ["got 4 (int)", "recipe='bf16'"]),
    "NVFP4Linear recipe an unknown preset": (
        lambda: nv.NVFP4Linear(64, 32, recipe="fp4", rngs=nnx.Rngs(0)),
        ValueError, ["NVFP4Linear", "recipe='fp4'", "'mxfp4'"]),
    "NVFP4DotGeneral recipe a float": (
        lambda: nn.Dense(32, dot_general_cls=lambda: nv.NVFP4DotGeneral(
            recipe=0.5)).init(KEY, X), TypeError,
        ["got 0.5 (float)", "recipe=Recipe.nvfp4()"]),
    "master_weights: a float0 gradient of a float parameter": (
        lambda: _master_update(
            {"w": jnp.ones(2)},
            {"w": np.zeros(2, jax.dtypes.float0)}), TypeError,
        ["float32 parameter of shape (2,)", "float0",
         "the gradients jax.grad returns"]),
}

# --- Configs -------------------------------------------------------------------

CONFIGS = {
    "Operand block_2d a string": (
        lambda: Operand(block_2d="false"), TypeError,
        ["Operand.block_2d", "'false' (str)", "block_2d=True"]),
    "Operand rht an int": (
        lambda: Operand(rht=1), TypeError, ["Operand.rht", "1 (int)",
                                            "rht=True"]),
    "Operand four_over_six a string": (
        lambda: Operand(four_over_six="weights"), TypeError,
        ["Operand.four_over_six", "'weights'", "four_over_six=True"]),
    "Operand format None": (
        lambda: Operand(format=None), TypeError,
        ["Operand.format", "None", "format='nvfp4'"]),
    "Operand rounding capitalized": (
        lambda: Operand(rounding="Stochastic"), ValueError,
        ["'Stochastic'", "'nearest' or 'stochastic'"]),
    "Recipe rht_size a string": (
        lambda: Recipe.nvfp4(rht_size="16"), TypeError,
        ["Recipe.rht_size", "'16' (str)", "rht_size=16"]),
    "Recipe residuals a list": (
        lambda: Recipe(residuals=["codes"]), TypeError,
        ["Recipe.residuals", "['codes']", "residuals='codes'"]),
    "Recipe name an int": (
        lambda: Recipe(name=5), TypeError, ["Recipe.name", "5 (int)"]),
    "Recipe operand a string": (
        lambda: Recipe(fprop_x="nvfp4"), TypeError,
        ["Recipe.fprop_x", "'nvfp4'", "fprop_x=Operand(format='nvfp4')"]),
    "Recipe.nvfp4 rht a string": (
        lambda: Recipe.nvfp4(rht="no"), TypeError,
        ["rht", "'no' (str)", "rht=True"]),
    "Recipe.nvfp4 stochastic_rounding a string": (
        lambda: Recipe.nvfp4(stochastic_rounding="False"), TypeError,
        ["stochastic_rounding", "'False'", "stochastic_rounding=True"]),
    "Recipe.nvfp4 four_over_six unknown": (
        lambda: Recipe.nvfp4(four_over_six="both"), ValueError,
        ["four_over_six='both'", "'weights'", "True/False"]),
    "Recipe.mxfp4 stochastic_rounding an int": (
        lambda: Recipe.mxfp4(stochastic_rounding=0), TypeError,
        ["stochastic_rounding", "0 (int)"]),
    "Recipe.from_name unknown": (
        lambda: Recipe.from_name("fp4"), ValueError,
        ["'fp4'", "'nvfp4'", "Recipe.nvfp4(rht=False)"]),
    "LateSwitch step a bool": (
        lambda: nv.LateSwitch(step=True), ValueError,
        ["LateSwitch.step", "True", "step=9000"]),
    "LateSwitch mode an int": (
        lambda: nv.LateSwitch(step=5, mode=1), TypeError,
        ["LateSwitch.mode", "1 (int)", "mode='forward'"]),
    "TrainConfig steps a bool": (
        lambda: TrainConfig(steps=True), TypeError,
        ["TrainConfig.steps", "True (bool)", "steps=200"]),
    "TrainConfig diagnostics a string": (
        lambda: TrainConfig(diagnostics="no"), TypeError,
        ["TrainConfig.diagnostics", "'no'", "diagnostics=True"]),
    "TrainConfig sr an int": (
        lambda: TrainConfig(sr=0), TypeError,
        ["TrainConfig.sr", "0 (int)", "sr=True"]),
    "TrainConfig sequence_parallel a string": (
        lambda: TrainConfig(sequence_parallel="on"), TypeError,
        ["TrainConfig.sequence_parallel", "'on' (str)",
         "sequence_parallel=False"]),
    "TrainConfig collective_matmul without sequence_parallel": (
        lambda: TrainConfig(collective_matmul=True), ValueError,
        ["collective_matmul=True needs sequence_parallel=True",
         "--sequence-parallel --collective-matmul"]),
    "TrainConfig lr a string": (
        lambda: TrainConfig(lr="3e-3"), TypeError,
        ["TrainConfig.lr", "'3e-3'", "lr=0.003"]),
    "TrainConfig warmup_steps a float": (
        lambda: TrainConfig(warmup_steps=2.5), TypeError,
        ["TrainConfig.warmup_steps", "2.5", "or None"]),
    "TrainConfig decay_fraction a string": (
        lambda: TrainConfig(decay_fraction="0.2"), TypeError,
        ["TrainConfig.decay_fraction", "'0.2'", "decay_fraction=0.2"]),
    "TrainConfig preset a list": (
        lambda: TrainConfig(preset=["tiny"]), TypeError,
        ["TrainConfig.preset", "['tiny']", "preset='tiny'"]),
    "TrainConfig b1 out of range": (
        lambda: TrainConfig(b1=1.5), ValueError, ["b1", "1.5", "[0, 1)"]),
    "GPTConfig d_model a float": (
        lambda: GPTConfig(d_model=64.0), TypeError,
        ["GPTConfig.d_model", "64.0 (float)", "d_model=128"]),
    "GPTConfig num_layers a bool": (
        lambda: GPTConfig(num_layers=True), TypeError,
        ["GPTConfig.num_layers", "True (bool)"]),
    "GPTConfig dtype a jnp dtype": (
        lambda: GPTConfig(dtype=jnp.float32), TypeError,
        ["GPTConfig.dtype", "float32", "dtype='float32'"]),
    "GPTConfig norm_eps negative": (
        lambda: GPTConfig(norm_eps=-1.0), ValueError,
        ["GPTConfig.norm_eps", "-1.0", "positive finite"]),
}

# --- Rules and meshes ------------------------------------------------------------

RULES = {
    "paper_rules block_name without {}": (
        lambda: nv.paper_rules(12, block_name="encoderblock"), ValueError,
        ["block_name='encoderblock'", "'encoderblock_{}'", "no block stays"]),
    "paper_rules block_name with two {}": (
        lambda: nv.paper_rules(12, block_name="block_{}_{}"), ValueError,
        ["block_name='block_{}_{}'", "'block_{}'"]),
    "paper_rules num_blocks a float": (
        lambda: nv.paper_rules(12.0), TypeError,
        ["num_blocks", "12.0 (float)", "num_blocks=12"]),
    "paper_rules first a string": (
        lambda: nv.paper_rules(12, first="2"), TypeError,
        ["first", "'2' (str)", "first=2"]),
    "rules a dict": (
        lambda: nv.PrecisionRules(rules={"block_0/": BF16}), TypeError,
        ["PrecisionRules.rules", "got a dict", "tuple(rules.items())"]),
    "rules one pair missing its comma": (
        lambda: nv.PrecisionRules(rules=("block_0/", BF16)), TypeError,
        ["one pair ('block_0/'", "trailing comma", "(('block_0/', ...),)"]),
    "rules a string": (
        lambda: nv.PrecisionRules(rules="block_0/"), TypeError,
        ["'block_0/'", "((pattern, Recipe), ...)"]),
    "rules an entry not a pair": (
        lambda: nv.PrecisionRules(rules=(("a", BF16, 1),)), ValueError,
        ["('a',", "a rule is a (pattern, Recipe) pair"]),
    "rule pattern an invalid regex": (
        lambda: nv.PrecisionRules(rules=(("(", BF16),)), ValueError,
        ["bad rule pattern '('"]),
    "rule recipe a string": (
        lambda: nv.PrecisionRules(rules=(("a", "bf16"),)), TypeError,
        ["rule 'a' maps to str 'bf16'", "Recipe.bf16()"]),
    "precision_rules given a Recipe": (
        lambda: nv.precision_rules(BF16).__enter__(), TypeError,
        ["precision_rules needs PrecisionRules"]),
    "MeshRules invalid regex": (
        lambda: nv.MeshRules(mesh=_mesh(), tensor_parallel=(("(", "row"),)),
        ValueError, ["bad pattern '('", "r'(^|/)attn/qkv$'"]),
    "MeshRules one pair missing its comma": (
        lambda: nv.MeshRules(mesh=_mesh(), tensor_parallel=("qkv", "column")),
        TypeError, ["('qkv', 'column')", "trailing comma"]),
    "MeshRules tensor_parallel a dict": (
        lambda: nv.MeshRules(mesh=_mesh(), tensor_parallel={"qkv": "column"}),
        TypeError, ["{'qkv': 'column'}", "ordered tuple"]),
    "MeshRules unknown style": (
        lambda: nv.MeshRules(mesh=_mesh(), tensor_parallel=(("q", "diag"),)),
        ValueError, ["'q'", "'diag'", "('column', 'row')"]),
    "PartitionSpec naming an axis the mesh lacks": (
        lambda: nv.sharding.quantize(X, _mesh(), P("tensor", None)),
        ValueError, ["P('tensor', None)", "'tensor'",
                     "('data', 'fsdp', 'model')"]),
    "PartitionSpec with too many entries": (
        lambda: nv.sharding.quantize(X, _mesh(), P(None, None, "data")),
        ValueError, ["3 entries", "(32, 64)", "one entry"]),
    "MeshRules partial sums in an unknown dtype": (
        lambda: nv.MeshRules(mesh=_mesh(), partial_sums="bf16"),
        ValueError, ["partial_sums='bf16'", "('float32', 'output')"]),
    "MeshRules collective_matmul without sequence_parallel": (
        lambda: nv.MeshRules(mesh=_mesh(), collective_matmul=True),
        ValueError, ["MeshRules(collective_matmul=True) needs "
                     "sequence_parallel=True"]),
    "MeshRules sequence_parallel a string": (
        lambda: nv.MeshRules(mesh=_mesh(), sequence_parallel="yes"),
        TypeError, ["MeshRules(sequence_parallel='yes')", "True or False"]),
    "MeshRules amax in an unknown scope": (
        lambda: nv.MeshRules(mesh=_mesh(), amax="per_device"),
        ValueError, ["amax='per_device'", "('global', 'local')"]),
    "MeshRules weight gradients on an unknown schedule": (
        lambda: nv.MeshRules(mesh=_mesh(), wgrad_schedule="late"),
        ValueError, ["wgrad_schedule='late'", "('layer', 'xla')"]),
    "MeshRules weight gradients summed in an unknown dtype": (
        lambda: nv.MeshRules(mesh=_mesh(), wgrad_sums="fp16"),
        ValueError, ["wgrad_sums='fp16'", "('float32', 'bfloat16')"]),
    "MeshRules.shardings naming an axis the mesh lacks": (
        lambda: nv.MeshRules(mesh=_mesh()).shardings({"w": P("tensor")}),
        ValueError, ["P('tensor',)", "'tensor'", "('data', 'fsdp', 'model')"]),
}


# --- Export files -----------------------------------------------------------------

class MLP(nn.Module):
  """Two NVFP4 layers: the smallest model an export packs."""

  hidden: int = 32

  @nn.compact
  def __call__(self, x):
    return nv.NVFP4Dense(16, name="down")(
        nn.relu(nv.NVFP4Dense(self.hidden, name="up")(x)))


TOKENS = jax.random.normal(jax.random.key(3), (4, 32))
LAYER = "up"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A packed export of both layers of `MLP`."""
  model = MLP()
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    params = model.init(jax.random.key(0), TOKENS)["params"]
  path = tmp_path_factory.mktemp("export") / "mlp.safetensors"
  info = export.save(path, model, params, nv.PrecisionRules(), TOKENS)
  assert info["quantized"] == ["down", "up"]
  return model, params, path


def _edited(exported, tmp_path, edit):
  """A copy of the export with `edit(tensors, layers_meta)` applied."""
  _, _, path = exported
  tensors, meta = safetensors.load(path)
  tensors = dict(tensors)
  layers = json.loads(meta["layers"])
  edit(tensors, layers)
  meta["layers"] = json.dumps(layers)
  out = tmp_path / "edited.safetensors"
  safetensors.save(out, tensors, meta)
  return out


def _scale_e5m2(exported, tmp_path):
  # The header edited in place: F8_E4M3 -> F8_E5M2, the same byte count.
  _, _, path = exported
  raw = path.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  name = f"{LAYER.replace('/', '.')}.weight_scale"
  assert header[name]["dtype"] == "F8_E4M3"
  begin = raw.index(json.dumps(name).encode(), 8)
  at = raw.index(b'"F8_E4M3"', begin)
  out = tmp_path / "e5m2.safetensors"
  out.write_bytes(raw[:at] + b'"F8_E5M2"' + raw[at + 9:])
  return out


def _other_shape(t, _):
  name = LAYER.replace("/", ".")
  t[f"{name}.weight"] = t[f"{name}.weight"][:, :8]
  t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"][:, :1]


def _other_amax(t, _):
  t[f"{LAYER.replace('/', '.')}.weight_amax"] = np.float32(7.0)


def _meta_without_block_2d(_, layers):
  del layers[LAYER]["block_2d"]


def _old_file_other_model(exported, tmp_path):
  # A file whose metadata has no shapes (as before this check), applied to
  # a model with a wider hidden layer: the packed `up` weight does not fit.
  def edit(_, layers):
    for meta in layers.values():
      del meta["shape"]
  return _edited(exported, tmp_path, edit)


EXPORTS = {
    "save with rules=None": (
        lambda e, t: export.save(t / "x.safetensors", e[0], e[1], None,
                                 TOKENS), TypeError,
        ["rules must be the PrecisionRules", "got None", "paper_rules"]),
    "weight_scale's dtype edited to F8_E5M2": (
        lambda e, t: export.load(_scale_e5m2(e, t)),
        safetensors.SafetensorsError,
        [f"'{LAYER}'", "float8_e5m2", "not float8_e4m3fn", "re-export"]),
    "a weight of another shape": (
        lambda e, t: export.load(_edited(e, t, _other_shape)),
        safetensors.SafetensorsError,
        [f"'{LAYER}'", "shape [32, 16]", "exported with [32, 32]",
         "re-export"]),
    "an amax its tensor factor does not match": (
        lambda e, t: export.load(_edited(e, t, _other_amax)),
        safetensors.SafetensorsError,
        [f"'{LAYER}'", "weight_scale_2", "amax 7.0", "re-export"]),
    "layer metadata without block_2d": (
        lambda e, t: export.load(_edited(e, t, _meta_without_block_2d)),
        safetensors.SafetensorsError,
        [f"'{LAYER}'", "damaged metadata", "re-export"]),
    "apply to a model of another size": (
        lambda e, t: export.apply(
            MLP(hidden=48), export.load(_old_file_other_model(e, t)),
            TOKENS),
        ValueError, ["'up'", "(32, 32)", "32 -> 48",
                     "the file was exported from"]),
    "apply with an unknown mode": (
        lambda e, t: export.apply(e[0], export.load(e[2]), TOKENS,
                                  mode="w4"),
        ValueError, ["'w4'", "'weight_only'"]),
}


@pytest.mark.parametrize("call, error, fragments", table_params(LAYERS))
def test_layers_name_the_value_and_the_fix(call, error, fragments):
  assert_error(call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", table_params(CONFIGS))
def test_configs_check_their_field_types(call, error, fragments):
  assert_error(call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", table_params(RULES))
def test_rules_and_meshes_name_the_value_and_the_fix(call, error, fragments):
  assert_error(call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", table_params(EXPORTS))
def test_export_files_are_checked_against_metadata_and_model(
    call, error, fragments, exported, tmp_path):
  assert_error(lambda: call(exported, tmp_path), error, fragments)


def test_export_cli_refuses_a_directory_as_output(tmp_path):
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    status = export_cli.main([str(tmp_path), str(tmp_path)])
  assert status == 2
  lines = err.getvalue().splitlines()
  assert len(lines) == 1 and "Traceback" not in err.getvalue()
  assert str(tmp_path) in lines[0] and "is a directory" in lines[0]
  assert ".safetensors file to write" in lines[0]


# --- Inputs that are right, with their verified results ---------------------


def test_bf16_dot_general_is_lax_dot_general_exactly():
  # The issue's case: the operands are not cast before the product.
  for lhs, rhs, pet in ((X, W, jnp.bfloat16),
                        (X.astype(jnp.bfloat16), W, jnp.float32),
                        (X, W, None)):
    want = jax.lax.dot_general(lhs, rhs, DN, preferred_element_type=pet)
    got = nv.dot_general(lhs, rhs, DN, recipe=BF16,
                         preferred_element_type=pet)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(want, np.float32))
  grads = [jax.grad(lambda a, b, f=f: f(a, b).astype(jnp.float32).sum(),
                    argnums=(0, 1))(X, W)
           for f in (lambda a, b: jax.lax.dot_general(
                         a, b, DN, preferred_element_type=jnp.bfloat16),
                     lambda a, b: nv.dot_general(
                         a, b, DN, recipe="bf16",
                         preferred_element_type=jnp.bfloat16))]
  jax.tree.map(np.testing.assert_array_equal, grads[0], grads[1])


def test_no_tokens_under_nvfp4_is_the_exact_empty_product():
  x = jnp.zeros((0, 64))
  y = nv.dot_general(x, W, DN, recipe="nvfp4", key=KEY)
  grad = jax.grad(lambda w: nv.dot_general(x, w, DN, recipe="nvfp4",
                                           key=KEY).sum())(W)
  assert y.shape == (0, 32)
  np.testing.assert_array_equal(grad, np.zeros_like(W))


def test_a_preset_name_is_that_preset():
  want = nv.dot_general(X, W, DN, recipe=Recipe.nvfp4(), key=KEY)
  np.testing.assert_array_equal(
      nv.dot_general(X, W, DN, recipe="nvfp4", key=KEY), want)
  for name in ("nvfp4", "bf16", "mxfp4", "mxfp8"):
    layer = nv.NVFP4Dense(32, recipe=name)
    params = layer.init(KEY, X)
    rngs = {"nvfp4": KEY}
    np.testing.assert_array_equal(
        layer.apply(params, X, rngs=rngs),
        nv.NVFP4Dense(32, recipe=Recipe.from_name(name)).apply(
            params, X, rngs=rngs))
  # "bf16" is nn.Dense, bit for bit (same parameter tree too).
  dense = nn.Dense(32)
  params = dense.init(KEY, X)
  np.testing.assert_array_equal(
      nv.NVFP4Dense(32, recipe="bf16").apply(params, X),
      dense.apply(params, X))
  linear = nv.NVFP4Linear(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0))
  assert linear.recipe == Recipe.mxfp4()


def test_master_weights_leave_integer_leaves_untouched():
  params = {"w": jnp.ones((2,), jnp.bfloat16), "count": jnp.array([5]),
            "phase": jnp.array([1 + 2j], jnp.complex64)}
  grads = {"w": jnp.ones((2,), jnp.bfloat16), "count": jnp.array([1]),
           "phase": jnp.array([1 + 1j], jnp.complex64)}
  new, state = _master_update(params, grads)
  np.testing.assert_array_equal(new["count"], [5])
  # A complex leaf is trained on a complex64 master (tests/training/test_optim.py
  # holds it to optax's own steps): SGD at 0.5, real and imaginary parts.
  np.testing.assert_array_equal(new["phase"], [0.5 + 1.5j])
  assert new["phase"].dtype == jnp.complex64
  # The float leaf is trained as plain SGD on an FP32 master would.
  np.testing.assert_array_equal(new["w"], jnp.full((2,), 0.5, jnp.bfloat16))
  master = nv.master_params(state)
  assert master["w"].dtype == jnp.float32
  np.testing.assert_array_equal(master["count"], [5])
  # float0: what jax.grad(..., allow_int=True) gives an integer parameter.
  p = {"w": jnp.ones(2), "count": jnp.array([5])}
  g = jax.grad(lambda p: (p["w"] * p["count"]).sum(), allow_int=True)(p)
  assert g["count"].dtype == jax.dtypes.float0
  new, _ = _master_update(p, g)
  np.testing.assert_array_equal(new["count"], [5])
  np.testing.assert_array_equal(new["w"], [-1.5, -1.5])


def test_amax_of_zeros_and_traced_amax_are_documented_results():
  zeros = jnp.zeros((2, 16))
  np.testing.assert_array_equal(
      nv.dequantize(nv.quantize(zeros, amax=0.0)), zeros)
  # Under jit the amax is not known: used as given (the documented result:
  # NaN or wrong values; which, depends on the backend's arithmetic).
  f = jax.jit(lambda x, a: nv.dequantize(nv.quantize(x, amax=a)))
  x = X[:2, :16]
  out = np.asarray(f(x, jnp.float32(-1.0)))
  right = np.asarray(f(x, jnp.max(jnp.abs(x))))
  assert np.isnan(out).any() or not np.array_equal(out, right)


def test_paper_rules_with_the_models_own_names_keep_its_blocks_in_bf16():
  rules = nv.paper_rules(12, block_name="encoderblock_{}")
  names = {i: rules.recipe_for(f"Transformer/encoderblock_{i}/MlpBlock_0/"
                               f"Dense_0").name for i in range(12)}
  assert [i for i, n in names.items() if n == "bf16"] == [0, 1, 10, 11]


def test_the_table_covers_the_issues_families():
  # With the public ops' table (26 cases, `tests/ops/test_op_errors.py`),
  # the families hold the issue's 60 cases at least.
  counts = {name: len(t) for name, t in (
      ("layers", LAYERS), ("configs", CONFIGS), ("rules", RULES),
      ("exports", EXPORTS))}
  assert all(counts.values()) and sum(counts.values()) >= 60 - 26, counts
