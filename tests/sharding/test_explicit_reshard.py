"""Sharding in types, as forgiving as auto mode (issue 58, item 4).

Under `jax.set_mesh` with Explicit axes an NVFP4 layer reads its split from
its operands' types. Where that split would cut a block of an operand (a
token shard that is not a multiple of the Wgrad operands' 16-token blocks, a
weight's `in` split that cuts 16x16 tiles), the layer runs on the closest
split that cuts none (`LinearSharding.fitted`: the operands all-gathered
over the offending axis), and the result is resharded back to the types'
split: it equals one device's, as in auto mode. A split that cuts nothing
runs as before: no gather appears.

The checks need 8 host CPU devices, so they run in a fresh process (this
file as a script, `XLA_FLAGS=--xla_force_host_platform_device_count=8` set
before jax is imported; the pytest worker has imported jax already), once
for the module; each test reads its check's lines. Tolerances are derived
in `check_layer_tile` (`mesh_checks.gemm_bound`) and `check_vit`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

if __name__ == "__main__":
  # Before jax is imported (mesh_checks sets the device count and imports it).
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "support"))
  import mesh_checks  # noqa: F401  pylint: disable=unused-import

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
U = 2.0 ** -24


def _explicit_mesh(shape, axes):
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes))


def _explicit() -> bool:
  """Whether the mesh in context has Explicit axes (sharding in types)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types)


def _gathers(compiled):
  """The dtypes of each all-gather inside the NVFP4 layers' name scopes of
  a compiled program, and the number of all-gathers anywhere."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  cs = [c for c in nv.sharding.collectives(compiled) if not c.trivial
        and c.op == "all-gather"]
  return [set(c.dtypes) for c in cs if "nvfp4_layer[" in c.line], len(cs)


def _dense_step(features, x, kernel_spec, dy, key, whole=True):
  """`NVFP4Dense(features)` on `x` split over `batch` of an Explicit
  8-device mesh and its kernel split as `kernel_spec` (no bias: its
  gradient is XLA's own sum, not the op's): the compiled step, its output
  and gradients for output gradient `dy` (their types checked to be the
  operands'), and with `whole` the same on one device."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  layer = nv.NVFP4Dense(features, use_bias=False)
  kernel = jax.random.normal(jax.random.key(2), (x.shape[-1], features)) / 8

  def step(x, kernel, dy):
    def f(x, kernel):
      return layer.apply({"params": {"kernel": kernel}}, x,
                         rngs={"nvfp4": key})
    y, vjp = jax.vjp(f, x, kernel)
    return (y, *vjp(dy))
  ref = jax.device_get(jax.jit(step)(x, kernel, dy)) if whole else None
  with jax.set_mesh(_explicit_mesh((8,), ("batch",))):
    args = (jax.device_put(x, P("batch")),
            jax.device_put(kernel, kernel_spec),
            jax.device_put(dy, P("batch")))
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
  # The results' types are the operands' (resharded back where the layer
  # ran on another split).
  for a, want in zip(got, (args[2], args[0], args[1])):
    assert a.sharding.is_equivalent_to(want.sharding, a.ndim), (
        a.sharding, want.sharding)
  return compiled, jax.device_get(got), ref


def check_layer_tokens():
  """20 tokens per shard (32 images of 5 tokens over 8 devices) would cut
  the Wgrad operands' 16-token blocks: the layer runs on all 160 tokens on
  every device (X and dY gathered in FP32), so its output and gradients
  equal one device's bit for bit. 64 tokens per shard (a supported split):
  the split is kept and no all-gather appears at all."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  key = jax.random.key(3)
  m = _explicit_mesh((8,), ("batch",))
  x = jax.random.normal(jax.random.key(0), (32, 5, 64))
  dy = jax.random.normal(jax.random.key(1), (32, 5, 48))
  compiled, got, whole = _dense_step(48, x, P(), dy, key)
  for what, a, b in zip(("y", "dx", "dw"), got, whole):
    assert np.array_equal(a, b), what
  inside, _ = _gathers(compiled)
  assert {"f32"} in inside, inside  # The fitted split gathers X and dY.
  sh = nv.sharding.linear_sharding_for(m, P("batch"), P())
  assert sh.fitted(nv.Recipe.nvfp4(), 160, 64, 48).tokens == ()
  print("layer tokens 20 per shard: y, dx, dw equal one device bit for bit; "
        f"gathers in the layer {inside}")

  # The same split declared (`sharding=`, as `MeshRules` give it) keeps
  # its error, as in auto mode: the caller asked for exactly that split.
  with jax.set_mesh(m):
    try:
      jax.eval_shape(lambda x, w: nv.dot_general(
          x, w, (((2,), (0,)), ((), ())), recipe="nvfp4", key=key,
          sharding=nv.sharding.LinearSharding(mesh=m, tokens=("batch",))),
                     jax.device_put(x, P("batch")),
                     jax.device_put(jnp.ones((64, 48)), P()))
    except ValueError as e:
      assert "shards of 20, not a multiple of 16" in str(e), e
    else:
      raise AssertionError("no error for a declared split of 20 tokens")

  x = jax.random.normal(jax.random.key(0), (32, 16, 64))
  dy = jax.random.normal(jax.random.key(1), (32, 16, 48))
  assert sh.fitted(nv.Recipe.nvfp4(), 512, 64, 48) is sh  # Kept as it is.
  compiled, _, _ = _dense_step(48, x, P(), dy, key, whole=False)
  inside, anywhere = _gathers(compiled)
  assert anywhere == 0, inside
  print("layer tokens 64 per shard: no all-gather")


def _op_step(x, w, dy, key, mesh, specs):
  """`nv.dot_general` (the op `NVFP4Dense` calls) and its gradients on one
  device and under `mesh` with the operands `(x, w, dy)` split as `specs`
  (the results' types checked to be the operands'): `(whole, got,
  compiled)`."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top

  def step(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe="nvfp4", key=key,
        name="mlp/up"), x, w)
    return (y, *vjp(dy))
  whole = jax.device_get(jax.jit(step)(x, w, dy))
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, s) for a, s in zip((x, w, dy), specs)]
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
  for a, want in zip(got, (args[2], args[0], args[1])):
    assert a.sharding.is_equivalent_to(want.sharding, 2), (a.sharding,
                                                          want.sharding)
  return whole, jax.device_get(got), compiled


def check_layer_tile():
  """Weight splits that would cut its 16x16 tiles: `[48, 64]` split along
  `in` over 8 devices (FSDP as the user's types write it: 6 rows a shard),
  and `[64, 48]` split along `out` over a 2-device `tensor` axis (column
  parallelism: 24 columns a shard). The layer gathers the weight (FP32)
  and keeps the tokens split (64 and 128 a shard); its gradient and Y are
  resharded back to the types' splits. Y and dX are each token's own rows
  of the whole weight's GEMMs: bit for bit. dW sums the token shards' FP32
  products in another order than one device: within
  `mesh_checks.gemm_bound` (2 (n + 3) u sum_i |a_i b_i| over the quantized
  Wgrad operands, n = 512 tokens)."""
  import mesh_checks as mc  # pylint: disable=g-import-not-at-top
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  recipe, key = nv.Recipe.nvfp4(), jax.random.key(3)
  fsdp = _explicit_mesh((8,), ("batch",))
  tensor = _explicit_mesh((4, 2), ("batch", "tensor"))
  for what, mesh, (k, n), specs, field in (
      ("in=48 over 8", fsdp, (48, 64), (P("batch"), P("batch"),
                                        P("batch")), "fsdp"),
      ("out=48 over tensor=2", tensor, (64, 48),
       (P("batch"), P(None, "tensor"), P("batch", "tensor")), "tensor")):
    x = jax.random.normal(jax.random.key(0), (512, k))
    w = jax.random.normal(jax.random.key(2), (k, n)) / 8
    dy = jax.random.normal(jax.random.key(1), (512, n))
    whole, got, compiled = _op_step(x, w, dy, key, mesh, specs)
    for name, a, b in zip(("y", "dx"), got, whole):
      assert np.array_equal(a, b), (what, name)
    _, qxt, _, qdyt, _ = mc._operands(recipe, x, w, dy, key)  # pylint: disable=protected-access
    mc.check_within(got[2], whole[2], mc.gemm_bound(qxt, qdyt, 512), "dw")
    # The weight, gathered whole. Anywhere in the program (which is this op
    # alone): jax 0.11 places the reshard's gather outside the layer's name
    # scope, jax 0.10 inside it.
    inside = [set(c.dtypes) for c in nv.sharding.collectives(compiled)
              if not c.trivial and c.op == "all-gather"]
    assert {"f32"} in inside, inside
    sh = nv.sharding.linear_sharding_for(mesh, specs[0], specs[1])
    assert getattr(sh, field) is not None, sh
    assert getattr(sh.fitted(recipe, 512, k, n), field) is None
    print(f"layer tile: {what} cuts 16x16 tiles: y, dx equal bit for bit, "
          f"dw within the bound; gathers in the layer {inside}")


def _vit_jnp(jnp_module):
  """`jax.numpy` for the vendored ViT's module, with a `concatenate` that
  reshards its operands to the most split one's sharding: the published
  code concatenates a replicated class token to the batch-split patches,
  which sharding in types rejects in the model itself (with or without this
  library); a user writes that reshard to run it. Everything else is
  `jax.numpy` itself."""
  import types  # pylint: disable=g-import-not-at-top
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top

  def concatenate(arrays, axis=0, **kwargs):
    specs = [jax.typeof(a).sharding.spec for a in arrays]
    target = max(specs, key=lambda s: len(nv.core.spmd.spec_axes(s)))
    if _explicit():
      arrays = [jax.sharding.reshard(a, target) for a in arrays]
    return jnp_module.concatenate(arrays, axis, **kwargs)
  names = {k: getattr(jnp_module, k) for k in dir(jnp_module)
           if not k.startswith("__") and k != "concatenate"}
  return types.SimpleNamespace(**names, concatenate=concatenate)


def check_vit():
  """The vendored linen ViT (1 block; 8x8 images of 4x4 patches: 4 tokens
  and a class token each), 32 images over 8 devices on the user's `batch`
  axis, Explicit: every NVFP4 layer has 20 tokens a shard, so it runs on
  all 160 on every device. Each layer's output and gradients in the mesh
  step equal the single-device op on the same operands (captured from the
  mesh run) bit for bit; the loss equals the single-device model's within
  the model-level bound `2u((N - 1) + D F) * loss` of
  `mesh_checks.check_third_party` (N = 160 tokens, the depth and width
  counted as there): the model's own high-precision parts (the patch
  embedding's convolution, the head) run on 4 images a device and round
  differently from XLA:CPU's 32-image ones, as in auto mode."""
  import warnings  # pylint: disable=g-import-not-at-top
  import mesh_checks as mc  # pylint: disable=g-import-not-at-top
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  import test_third_party as tp  # pylint: disable=g-import-not-at-top
  vit = tp.models_vit
  vit.jnp = _vit_jnp(jnp)  # This process's own copy of the module.
  model = vit.VisionTransformer(**dict(tp.VIT, transformer=dict(
      tp.VIT["transformer"], num_layers=1)))
  images = jax.random.normal(jax.random.key(0), (32, 8, 8, 3))
  labels = jnp.arange(32) % 10
  params = jax.jit(lambda k: model.init(k, images[:2], train=False))(
      jax.random.key(1))
  # Every parameter gets a gradient (the head's init is zeros).
  params["params"]["head"]["kernel"] = 0.1 * jax.random.normal(
      jax.random.key(5), params["params"]["head"]["kernel"].shape)

  def loss_fn(params, images, labels):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # The head: high precision by shape.
      with nv.inject_linen(unsupported="high_precision", step=0):
        logits = model.apply(params, images, train=False)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits)
                             * jax.nn.one_hot(labels, 10), -1))

  m = _explicit_mesh((8,), ("batch",))
  rec = mc._LayerRecorder()  # pylint: disable=protected-access
  with jax.set_mesh(m), rec:
    args = (jax.device_put(params, P()), jax.device_put(images, P("batch")),
            jax.device_put(labels, P("batch")))
    jax.eval_shape(lambda *a: loss_fn(*a), *args)
    calls = rec.calls
    assert len(calls) == 6, [c["name"] for c in calls]
    zero = lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype),
                                    jax.typeof(a).sharding.spec)
    perturb = [{k: zero(c[v]) for k, v in (("x", "lhs"), ("w", "rhs"),
                                            ("y", "y"))} for c in calls]

    def run(perturb, *args):
      rec.perturb, rec.calls = perturb, []
      out = loss_fn(*args)
      return out, [{k: c[k] for k in ("lhs", "rhs", "y", "key")}
                   for c in rec.calls]
    compiled = jax.jit(jax.value_and_grad(run, has_aux=True)).lower(
        perturb, *args).compile()
    (loss, got), grads = jax.device_get(compiled(perturb, *args))
    rec.perturb = None
  inside, _ = _gathers(compiled)
  assert inside.count({"f32"}) >= 6, inside  # Each layer's X, at least.
  loss0 = float(jax.jit(loss_fn)(params, images, labels))

  def layers(got, dys):
    outs = []
    for c, g, dy in zip(calls, got, dys):
      y, vjp = jax.vjp(lambda x, w, c=c, g=g: nv.dot_general(
          x, w, c["dims"], None, c["dtype"], recipe=c["recipe"],
          key=g["key"]), g["lhs"], g["rhs"])
      outs.append((y, *vjp(dy)))
    return outs
  ref = jax.device_get(jax.jit(layers)(got, [d["y"] for d in grads]))
  for c, g, d, (y0, dx0, dw0) in zip(calls, got, grads, ref):
    for what, a, b in (("y", g["y"], y0), ("dx", d["x"], dx0),
                       ("dw", d["w"], dw0)):
      assert np.array_equal(a, b), (c["name"], what)
  tokens, depth, width = 160, 2 * (6 * 1 + 3), 64
  factor = 2 * U * ((tokens - 1) + depth * width)
  dl = abs(float(loss) - loss0)
  assert dl <= factor * loss0, (dl, factor * loss0)
  print(f"vit 20 tokens per shard: {len(calls)} NVFP4 layers' y, dx, dw "
        f"equal the single-device op bit for bit; loss {float(loss):.6f} "
        f"vs {loss0:.6f} on one device, |dloss| {dl:.2e} (bound "
        f"{factor * loss0:.1e}); gathers in the layers "
        f"{inside.count({'f32'})} f32")


CHECKS = {"layer_tokens": check_layer_tokens, "layer_tile": check_layer_tile,
          "vit": check_vit}


def _fit_cases():
  """`(sharding, tokens, k, n, recipe, expected changes or None: kept)`
  on abstract meshes (no devices needed)."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  from jax.sharding import AbstractMesh  # pylint: disable=g-import-not-at-top

  def mesh(**sizes):
    return AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Explicit,) * len(sizes))
  ls = nv.sharding.LinearSharding
  nvfp4 = nv.Recipe.nvfp4()
  dp = ls(mesh=mesh(batch=4, fsdp=2), tokens=("batch", "fsdp"), fsdp="fsdp")
  row = ls(mesh=mesh(batch=4, model=2), tokens=("batch",), tensor="row",
           model="model")
  col = ls(mesh=mesh(data=2, fsdp=2, model=2), tokens=("data", "fsdp"),
           tensor="column", model="model", fsdp="fsdp")
  seq = ls(mesh=mesh(data=4, model=2), tokens=("data",), tensor="column",
           model="model", sequence=True)
  return {
      # 17 tokens a shard: no token axis keeps whole blocks; `fsdp` goes
      # with the tokens it split.
      "17 per shard": (dp, 136, 64, 48, nvfp4, dict(tokens=(), fsdp=None)),
      # 24 a shard over both axes, 48 over `batch` (the major) alone.
      "24 per shard": (dp, 192, 64, 48, nvfp4,
                       dict(tokens=("batch",), fsdp=None)),
      "32 per shard": (dp, 256, 64, 48, nvfp4, None),
      # A row-parallel `in` of 24 a shard cuts X's blocks and the tiles.
      "row in=48": (row, 256, 48, 64, nvfp4, dict(tensor=None, model=None)),
      "row in=64": (row, 256, 64, 64, nvfp4, None),
      # FSDP on `in` (24 rows a shard) cuts tiles; `model` on `out` keeps
      # its 32 columns a shard.
      "fsdp in=48": (col, 256, 48, 64, nvfp4, dict(fsdp=None)),
      # Sequence parallelism: 24 tokens a shard over data x model.
      "sequence": (seq, 192, 64, 64, nvfp4, dict(sequence=False)),
      # Nothing blocked in BF16: any even split is kept.
      "bf16": (dp, 136, 64, 48, nv.Recipe.bf16(), None),
  }


@pytest.mark.parametrize("case", list(_fit_cases()))
def test_fitted_split_keeps_every_block_whole(case):
  """`LinearSharding.fitted` drops exactly the axes that would cut a block
  (minor token axes first, as auto mode's `fit_spec`), keeps a split that
  cuts none as it is (the same object: the layer's fast path unchanged),
  and what it returns passes `check`."""
  sh, tokens, k, n, recipe, changes = _fit_cases()[case]
  got = sh.fitted(recipe, tokens, k, n)
  if changes is None:
    assert got is sh
  else:
    with pytest.raises(ValueError, match="straddle"):
      sh.check(recipe, tokens, k, n)
    for field, value in changes.items():
      assert getattr(got, field) == value, (field, got)
    for field in ("tokens", "tensor", "model", "fsdp", "sequence"):
      if field not in changes:
        assert getattr(got, field) == getattr(sh, field), (field, got)
  got.check(recipe, tokens, k, n)



@pytest.fixture(scope="module")
def checks_output():
  """Runs every check in one process with 8 host CPU devices."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
          os.pathsep) if p]))
  proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  return proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(CHECKS))
def test_explicit_reshard(checks_output, name):
  assert f"[{name}] ok" in checks_output, checks_output[-8000:]


def main(names):
  assert len(jax.devices()) == 8, jax.devices()
  import time  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top
  for name in names:
    fn = CHECKS[name]
    t0 = time.perf_counter()
    try:
      fn()
    except Exception:  # pylint: disable=broad-except
      print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
    else:
      print(f"[{name}] ok in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or list(CHECKS))
