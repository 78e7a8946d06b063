"""The vendored third-party models (linen ViT, NNX lm1b, a MaxText-style
block), switched with the library's one call and sharded the user's way."""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from mesh_checks.common import U, gemm_bound
from mesh_checks.dot_general import layer_operands
from mesh_checks.gpt_step import assert_step_collectives


class LayerRecorder:
  """Wraps `nvfp4_jax.dot_general` as the NVFP4 layers call it: records
  each call's operands, recipe and key, and adds zero perturbations to its
  operands and result, whose gradients are the layer's dX, dW and dY."""

  def __init__(self):
    from nvfp4_jax.training import dot_general as ops  # pylint: disable=g-import-not-at-top
    self.ops, self.real = ops, ops.dot_general
    self.perturb, self.calls = None, []

  def __enter__(self):
    def wrapper(lhs, rhs, dims, precision=None, preferred_element_type=None,
                *, recipe, key=None, **kwargs):
      if kwargs.get("name") is None:  # Not a layer (a shape check).
        return self.real(lhs, rhs, dims, precision, preferred_element_type,
                         recipe=recipe, key=key, **kwargs)
      if self.perturb is not None:
        p = self.perturb[len(self.calls)]
        lhs, rhs = lhs + p["x"], rhs + p["w"]
      y = self.real(lhs, rhs, dims, precision, preferred_element_type,
                    recipe=recipe, key=key, **kwargs)
      if self.perturb is not None:
        y = y + p["y"]
      self.calls.append(dict(lhs=lhs, rhs=rhs, y=y, key=key, dims=dims,
                             recipe=recipe, dtype=preferred_element_type,
                             name=kwargs.get("name")))
      return y
    self.ops.dot_general = wrapper
    return self

  def __exit__(self, *exc):
    self.ops.dot_general = self.real


def _vit_case():
  """The vendored linen ViT, switched with `nv.inject_linen`; 16 images of
  16 patches (`classifier="gap"`: the published code concatenates its class
  token to a batch-split array, which sharding in types rejects in the
  model itself, with or without this library), the head's zero init
  replaced so every layer gets a gradient. FSDP as a user writes it: every
  linear kernel split along its first dimension over `fsdp`."""
  import warnings  # pylint: disable=g-import-not-at-top
  import test_third_party as tp  # pylint: disable=g-import-not-at-top
  model = tp.models_vit.VisionTransformer(**dict(tp.VIT, classifier="gap"))
  x = jax.random.normal(jax.random.key(0), (16, 16, 16, 3))
  y = jnp.arange(16) % 10
  params = jax.jit(lambda k: model.init(k, x[:2], train=False))(
      jax.random.key(1))
  head = params["params"]["head"]
  head["kernel"] = 0.1 * jax.random.normal(jax.random.key(5),
                                           head["kernel"].shape)

  def loss(params, x, y):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # The head: high precision by shape.
      with nv.inject_linen(unsupported="high_precision", step=0):
        logits = model.apply(params, x, train=False)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits)
                             * jax.nn.one_hot(y, 10), -1))

  def setup(m, mode, layout):
    del mode
    def spec(kp, a):
      path = jax.tree_util.keystr(kp)
      if (layout == "fsdp" and "kernel" in path and "embedding" not in path
          and "head" not in path):
        return NamedSharding(m, P("fsdp"))
      return NamedSharding(m, P())
    data = NamedSharding(m, P(("batch", "fsdp")))
    shardings = (jax.tree_util.tree_map_with_path(spec, params), data, data)
    return loss, jax.device_put((params, x, y), shardings), shardings
  # Depth and width of the loss bound as the GPT's (`check_gpt_step`):
  # pre-LN blocks, the widest feature axis the MLP's.
  return dict(setup=setup, axes=("batch", "fsdp"), tokens=16 * 16,
              depth=2 * (6 * 3 + 3), width=64, layers=3 * 6)


def _lm1b_case():
  """The vendored NNX lm1b `TransformerLM`, switched with `nv.inject_nnx`,
  built in the user's mesh (its own axes `data`, `fsdp`, `tensor`: 4 x 2 x
  1) with its own `nnx.with_partitioning` annotations: in auto mode FSDP
  is its config's `MeshRules(embed="fsdp")`; under Explicit axes the
  published model's LayerNorm multiplies batch-split activations by an
  `fsdp`-split scale, which sharding in types rejects in the model itself,
  so there FSDP splits the NVFP4 layers' kernels (their first dimension)
  and nothing else. Its embedding lookup is given the tokens' sharding
  (nnx.Embed's `out_sharding`; the published call passes none, which
  JAX rejects under Explicit axes)."""
  import warnings  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  import test_third_party as tp  # pylint: disable=g-import-not-at-top
  default = sys.modules["configs.default"]
  tokens = jax.random.randint(jax.random.key(0), (8, 32), 1, 100)

  class Embed(nnx.Embed):
    def __call__(self, inputs, out_sharding=None):
      sh = jax.typeof(inputs).sharding
      if out_sharding is None and AxisType.Explicit in tuple(
          sh.mesh.axis_types):
        out_sharding = sh
      return super().__call__(inputs, out_sharding=out_sharding)

  def loss(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    with nv.precision_rules(nv.PrecisionRules(), step=0):
      logits = model(tokens)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits)
                             * jax.nn.one_hot(tokens, 100), -1))

  def setup(m, mode, layout):
    rules = default.MeshRules(embed="fsdp" if (
        layout == "fsdp" and mode == "auto") else None)
    model = tp.lm1b.TransformerLM(tp.lm1b.TransformerConfig(
        **tp.LM_CFG, axis_rules=rules), rngs=nnx.Rngs(0))
    model.set_attributes(deterministic=True, decode=False)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # logitdense: high precision by shape.
      switched = nv.inject_nnx(model, unsupported="high_precision")
    if mode == "explicit":
      model.decoder.output_embed.__class__ = Embed
    graphdef, state = nnx.split(model)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    if mode == "explicit" and layout == "fsdp":
      def spec(kp, a):
        path = "/".join(str(k.key) for k in kp if hasattr(k, "key"))
        if path.endswith("/kernel") and path[:-len("/kernel")] in switched:
          return NamedSharding(m, P("fsdp"))
        return a.sharding
      shardings = jax.tree_util.tree_map_with_path(spec, state)
    data = NamedSharding(m, P(("data", "fsdp")))
    fn = functools.partial(loss, graphdef)
    args = (jax.device_put(state, shardings), jax.device_put(tokens, data))
    return fn, args, (shardings, data)
  return dict(setup=setup, axes=("data", "fsdp", "tensor"), tokens=8 * 32,
              depth=2 * (6 * 3 + 3), width=100, layers=3 * 6)


def _logical_case():
  """A MaxText-style linen block: NVFP4Dense layers whose kernels carry
  logical axis names (`nn.with_logical_partitioning`) and activations
  logical constraints (`nn.with_logical_constraint`), mapped to the mesh by
  the user's `logical_axis_rules` (data, fsdp, tensor: 2 x 2 x 2): the up
  projection column-parallel with FSDP, the down projection row-parallel
  with FSDP on its `out` dimension. In auto mode the parameters and batch
  enter `jax.jit` with `nn.logical_to_mesh_sharding`'s shardings."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  init = nn.initializers.lecun_normal()
  rules = (("activation_batch", ("data", "fsdp")), ("activation_mlp",
                                                   "tensor"),
           ("embed", "fsdp"), ("mlp", "tensor"))

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = nn.with_logical_constraint(x, ("activation_batch", None, None))
        h = nv.NVFP4Dense(64, use_bias=False, name=f"up_{i}",
                          kernel_init=nn.with_logical_partitioning(
                              init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(
            jax.nn.gelu(h), ("activation_batch", None, "activation_mlp"))
        x = x + nv.NVFP4Dense(32, use_bias=False, name=f"down_{i}",
                              kernel_init=nn.with_logical_partitioning(
                                  init, ("mlp", "embed")))(h)
      return x
  model = Mlp()
  x = jax.random.normal(jax.random.key(0), (8, 32, 32))
  boxed = jax.jit(model.init)(jax.random.key(1), x)
  params = nn.meta.unbox(boxed)

  def loss(params, x):
    with nn.logical_axis_rules(rules), nv.precision_rules(
        nv.PrecisionRules(), step=0):
      return jnp.mean(model.apply(params, x) ** 2)

  def setup(m, mode, layout):
    del mode, layout
    shardings = (nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed), m, rules),
                 NamedSharding(m, P(("data", "fsdp"))))
    return loss, jax.device_put((params, x), shardings), shardings
  return dict(setup=setup, axes=("data", "fsdp", "tensor"), shape=(2, 2, 2),
              tokens=8 * 32, depth=2 * (2 * 2), width=64, layers=4)


def check_third_party(models=("vit", "lm1b"), modes=("explicit", "auto"),
                      layouts=("data", "fsdp")):
  """A third-party model, switched with the library's one call, sharded the
  user's way on a mesh with the user's axis names (8 devices: batch x fsdp
  = 4 x 2), under `jax.set_mesh` with Explicit axes and with `jax.jit`
  in_shardings (auto), against one device.

  Every NVFP4 layer's forward and gradients on the mesh (its operands and
  output gradient captured from the mesh run) equal the single-device op
  on the same operands within `gemm_bound` (the same quantized operands,
  FP32 sums in another order), and the loss equals the single-device
  model's on the same state within the model-level bound `2u((N - 1) +
  D F) * loss` of `check_gpt_step`."""
  cases = {"vit": _vit_case, "lm1b": _lm1b_case, "logical": _logical_case}
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  for model in models:
    case = cases[model]()
    factor = 2 * U * ((case["tokens"] - 1) + case["depth"] * case["width"])
    for mode in modes:
      kind = AxisType.Explicit if mode == "explicit" else AxisType.Auto
      axes = case["axes"]
      m = jax.make_mesh(case.get("shape", (4, 2, 1)[:len(axes)]), axes,
                        axis_types=(kind,) * len(axes))
      for layout in layouts:
        t0 = time.perf_counter()
        rec = LayerRecorder()
        with jax.set_mesh(m), rec:
          loss_fn, args, shardings = case["setup"](m, mode, layout)
          fsdp = {"fsdp" in nv.core.spmd.spec_axes(sh.spec)
                  for sh in jax.tree.leaves(shardings[0])
                  if isinstance(sh, NamedSharding)}
          assert (True in fsdp) == (layout == "fsdp"), (model, layout)
          # The layers' operand and result types, for their perturbations.
          # (A new function each time: no trace cached from another mesh.)
          jax.eval_shape(lambda *a: loss_fn(*a), *args)
          shapes = rec.calls
          assert len(shapes) == case["layers"], [c["name"] for c in shapes]
          if mode == "explicit":  # The kernels' types: split as set up.
            split = {"fsdp" in nv.core.spmd.spec_axes(
                jax.typeof(c["rhs"]).sharding.spec) for c in shapes}
            assert split == case.get("split", {layout == "fsdp"}), (
                model, layout, split)

          def zero(a):
            out = jnp.zeros(a.shape, a.dtype)
            return (jax.device_put(out, NamedSharding(
                m, jax.typeof(a).sharding.spec)) if mode == "explicit"
                    else out)
          perturb = [{"x": zero(c["lhs"]), "w": zero(c["rhs"]),
                      "y": zero(c["y"])} for c in shapes]

          def run(perturb, *args):
            rec.perturb, rec.calls = perturb, []
            out = loss_fn(*args)
            got = [{k: c[k] for k in ("lhs", "rhs", "y", "key")}
                   for c in rec.calls]
            return out, got
          step = jax.value_and_grad(run, has_aux=True)
          step = (jax.jit(step) if mode == "explicit" else
                  jax.jit(step, in_shardings=(None,) + tuple(shardings)))
          compiled = step.lower(perturb, *args).compile()
          (loss, got), grads = compiled(perturb, *args)
          rec.perturb = None
          if mode == "explicit":
            # No activation gathered for quantization; weights gathered
            # only as quantized bytes.
            assert_step_collectives(f"{model} {layout}", compiled)
          host = jax.device_get(args)
        with jax.set_mesh(jax.make_mesh((1,) * len(axes), axes, axis_types=(
            AxisType.Auto,) * len(axes))):
          loss0 = float(jax.jit(lambda *a: loss_fn(*a))(*host))
        dl = abs(float(loss) - loss0)
        assert dl <= factor * loss0, (model, mode, layout, dl)
        worst = 0.0
        for c, g, d in zip(shapes, got, grads):
          worst = max(worst, _check_layer(c, g, d))
        print(f" {model} {mode} {layout}: loss {loss0:.6f}, |dloss| "
              f"{dl:.2e} (bound {factor * loss0:.1e}); {len(got)} NVFP4 "
              f"layers within {100 * worst:.1f}% of their bound "
              f"({time.perf_counter() - t0:.1f}s)")


def check_third_party_vit():
  check_third_party(("vit",))


def check_third_party_lm1b():
  check_third_party(("lm1b",))


def check_logical_partitioning():
  check_third_party(("logical",), layouts=("fsdp",))


_LAYER_REF = {}


def _check_layer(call, got, grads):
  """One layer's mesh results against the single-device op on the same
  operands; returns the worst ratio of a difference to its bound."""
  lhs, rhs, key = (np.asarray(got[k]) if k != "key" else got[k]
                   for k in ("lhs", "rhs", "key"))
  dy = np.asarray(grads["y"])
  (lc, rc), _ = call["dims"]
  lf = [d for d in range(lhs.ndim) if d not in lc]
  rf = [d for d in range(rhs.ndim) if d not in rc]
  k = int(np.prod([lhs.shape[d] for d in lc]))
  x2 = np.transpose(lhs, lf + list(lc)).reshape(-1, k)
  w2 = np.transpose(rhs, list(rc) + rf).reshape(k, -1)
  t, n = x2.shape[0], w2.shape[1]
  recipe, dims, dtype = call["recipe"], call["dims"], call["dtype"]
  sig = (recipe, str(dims), str(dtype), lhs.shape, rhs.shape)
  if sig not in _LAYER_REF:
    def f(x, w, dy, key):
      y, vjp = jax.vjp(lambda x, w: nv.dot_general(
          x, w, dims, None, dtype, recipe=recipe, key=key), x, w)
      return (y, *vjp(dy))
    _LAYER_REF[sig] = jax.jit(f)
  y0, dx0, dw0 = _LAYER_REF[sig](lhs, rhs, dy, key)
  qx, qxt, qdy, qdyt, qw = layer_operands(recipe, jnp.asarray(x2),
                                     jnp.asarray(w2),
                                     jnp.asarray(dy.reshape(t, n)), key)
  worst = 0.0
  for what, mesh_v, ref, bound in (
      ("y", got["y"], y0, gemm_bound(qx, qw, k)),
      ("dx", grads["x"], dx0, gemm_bound(qdy, qw.T, n)),
      ("dw", grads["w"], dw0, gemm_bound(qxt, qdyt, t))):
    mesh_v, ref = np.asarray(mesh_v, np.float64), np.asarray(ref, np.float64)
    if what == "dx":
      mesh_v = np.transpose(mesh_v, lf + list(lc)).reshape(t, k)
      ref = np.transpose(ref, lf + list(lc)).reshape(t, k)
    elif what == "dw":
      mesh_v = np.transpose(mesh_v, list(rc) + rf).reshape(k, n)
      ref = np.transpose(ref, list(rc) + rf).reshape(k, n)
    else:
      mesh_v, ref = mesh_v.reshape(t, n), ref.reshape(t, n)
    err = np.abs(mesh_v - ref)
    assert np.all(err <= bound), (call["name"], what,
                                  float(np.max(err - bound)))
    worst = max(worst, float(np.max(err / np.maximum(bound, 1e-45))))
  return worst
