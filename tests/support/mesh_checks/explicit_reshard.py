"""Sharding in types, as forgiving as auto mode: where the operands' types
would cut a block, the layer runs on the closest split that cuts none and
reshards back (`LinearSharding.fitted`)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from mesh_checks.common import U, check_within, gemm_bound
from mesh_checks.dot_general import layer_operands
from mesh_checks.third_party import LayerRecorder


def _explicit_mesh(shape, axes):
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes))


def _explicit() -> bool:
  """Whether the mesh in context has Explicit axes (sharding in types)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types)


def _gathers(compiled):
  """The dtypes of each all-gather inside the NVFP4 layers' name scopes of
  a compiled program, and the number of all-gathers anywhere."""
  cs = [c for c in nv.sharding.collectives(compiled) if not c.trivial
        and c.op == "all-gather"]
  return [set(c.dtypes) for c in cs if "nvfp4_layer[" in c.line], len(cs)


def _dense_step(features, x, kernel_spec, dy, key, whole=True):
  """`NVFP4Dense(features)` on `x` split over `batch` of an Explicit
  8-device mesh and its kernel split as `kernel_spec` (no bias: its
  gradient is XLA's own sum, not the op's): the compiled step, its output
  and gradients for output gradient `dy` (their types checked to be the
  operands'), and with `whole` the same on one device."""
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
  `common.gemm_bound` (2 (n + 3) u sum_i |a_i b_i| over the quantized
  Wgrad operands, n = 512 tokens)."""
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
    _, qxt, _, qdyt, _ = layer_operands(recipe, x, w, dy, key)
    check_within(got[2], whole[2], gemm_bound(qxt, qdyt, 512), "dw")
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
  `third_party.check_third_party` (N = 160 tokens, the depth and width
  counted as there): the model's own high-precision parts (the patch
  embedding's convolution, the head) run on 4 images a device and round
  differently from XLA:CPU's 32-image ones, as in auto mode."""
  import warnings  # pylint: disable=g-import-not-at-top
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
  rec = LayerRecorder()
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
