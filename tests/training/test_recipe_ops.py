"""The recipe's custom_vjp dot_general and the NVFP4 layers (issue 3)."""

import io
import contextlib

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax as nv

T, K, N = 32, 64, 48


def heavy(key, shape, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, shape)
  x = x * jnp.exp(jax.random.normal(k2, shape[-1:]) * 1.5)  # Column scales.
  outliers = jax.random.bernoulli(k3, 0.01, shape) * 30.0
  return (x + outliers * jnp.sign(x)).astype(dtype)


def _vjp_layer(layer, params, x, dy, rngs=None):
  def f(params, x):
    return layer.apply(params, x, rngs=rngs)
  y, vjp = jax.vjp(f, params, x)
  dparams, dx = vjp(dy)
  return y, dparams["params"]["kernel"], dx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_recipe_equals_nn_dense(dtype):
  x = heavy(jax.random.key(0), (2, T // 2, K))
  dense = nn.Dense(N, dtype=dtype)
  layer = nv.NVFP4Dense(N, dtype=dtype, recipe=nv.Recipe.bf16())
  params = dense.init(jax.random.key(1), x)
  assert jax.tree.structure(layer.init(jax.random.key(1), x)) == \
      jax.tree.structure(params)
  dy = jax.random.normal(jax.random.key(2), (2, T // 2, N)).astype(dtype)
  y0, dk0, dx0 = _vjp_layer(dense, params, x, dy)
  y1, dk1, dx1 = _vjp_layer(layer, params, x, dy)
  np.testing.assert_array_equal(y1, y0)
  np.testing.assert_array_equal(dk1, dk0)
  np.testing.assert_array_equal(dx1, dx0)


def _deq(q):
  return nv.dequantize(q, jnp.float32)


def _mm(a, b):
  # FP32 matmuls default to TF32 on GPU: the reference needs true FP32.
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _close(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())


# 1x16 weights in the slow tier (the suite's time budget); the paper's 16x16
# weights in the fast one.
@pytest.mark.parametrize("two_d", [True, pytest.param(False,
                                                      marks=pytest.mark.slow)])
def test_matches_hand_composed_recipe_without_sr(two_d):
  recipe = nv.Recipe.nvfp4(stochastic_rounding=False, two_d_weights=two_d)
  x = heavy(jax.random.key(3), (T, K))
  layer = nv.NVFP4Dense(N, use_bias=False, recipe=recipe)
  params = layer.init(jax.random.key(4), x)
  kern = heavy(jax.random.key(5), (K, N)) * 0.05
  params = {"params": {"kernel": kern}}
  dy = heavy(jax.random.key(6), (T, N))
  y, dk, dx = _vjp_layer(layer, params, x, dy)

  # Fprop: X 1x16, W (= kernel^T) 16x16 (or 1x16), both RTNE.
  qx = nv.quantize(x)
  qw = nv.quantize(kern.T, block_2d=two_d)
  _close(y, _mm(_deq(qx), _deq(qw).T))
  # Dgrad: dY 1x16 along out; W along out: the same 16x16 quantized weight.
  qwd = nv.quantize(kern, block_2d=two_d)
  if two_d:
    np.testing.assert_array_equal(_deq(qwd), _deq(qw).T)
  _close(dx, _mm(_deq(nv.quantize(dy)), _deq(qwd).T))
  # Wgrad: RHT along tokens on both operands, 1x16 along tokens.
  qxt = nv.quantize(nv.rht(x.T))
  qdyt = nv.quantize(nv.rht(dy.T))
  _close(dk, _mm(_deq(qxt), _deq(qdyt).T))
  assert dk.dtype == jnp.float32


def test_wgrad_without_rht_differs_and_matches_plain_reference():
  recipe = nv.Recipe.nvfp4(stochastic_rounding=False, rht=False)
  x = heavy(jax.random.key(3), (T, K))
  kern = heavy(jax.random.key(5), (K, N)) * 0.05
  dy = heavy(jax.random.key(6), (T, N))
  layer = nv.NVFP4Dense(N, use_bias=False, recipe=recipe)
  _, dk, _ = _vjp_layer(layer, {"params": {"kernel": kern}}, x, dy)
  plain = _mm(_deq(nv.quantize(x.T)), _deq(nv.quantize(dy.T)).T)
  _close(dk, plain)
  with_rht = _mm(_deq(nv.quantize(nv.rht(x.T))),
                 _deq(nv.quantize(nv.rht(dy.T))).T)
  assert np.abs(np.asarray(dk - with_rht)).max() > 1e-3


def test_stochastic_rounding_keys():
  x = heavy(jax.random.key(7), (T, K))
  layer = nv.NVFP4Dense(N, recipe=nv.Recipe.nvfp4())
  params = layer.init(jax.random.key(8), x)
  dy = heavy(jax.random.key(9), (T, N))
  run = jax.jit(lambda k: _vjp_layer(layer, params, x, dy, {"nvfp4": k}))
  y1, dk1, dx1 = run(jax.random.key(1))
  y2, dk2, dx2 = run(jax.random.key(1))
  y3, dk3, dx3 = run(jax.random.key(2))
  np.testing.assert_array_equal(dk1, dk2)
  np.testing.assert_array_equal(dx1, dx2)
  np.testing.assert_array_equal(y1, y3)  # Fprop is RTNE: no key involved.
  assert np.any(np.asarray(dk1 != dk3)) and np.any(np.asarray(dx1 != dx3))


def test_layers_get_distinct_sr_keys():
  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nv.NVFP4Dense(N, name="a")(x) + nv.NVFP4Dense(N, name="b")(x)
  x = heavy(jax.random.key(7), (T, K))
  m = Twin()
  params = m.init(jax.random.key(0), x)
  same = {"a": params["params"]["a"], "b": params["params"]["a"]}
  g = jax.grad(lambda p: jnp.sum(m.apply({"params": p}, x,
                                         rngs={"nvfp4": jax.random.key(3)}) ** 2)
               )(same)
  assert np.any(np.asarray(g["a"]["kernel"] != g["b"]["kernel"]))


def test_sr_without_key_fails_on_backward_only():
  x = heavy(jax.random.key(7), (T, K))
  layer = nv.NVFP4Dense(N)
  params = layer.init(jax.random.key(8), x)  # Forward needs no key.
  with pytest.raises(ValueError, match="no key"):
    jax.grad(lambda p: layer.apply(p, x).sum())(params)


def test_residuals_are_saved_quantized():
  x = heavy(jax.random.key(10), (256, K), jnp.bfloat16)
  kern = heavy(jax.random.key(11), (K, N)) * 0.05
  f = lambda x, w: nv.dot_general(x, w, (((1,), (0,)), ((), ())),
                                  recipe=nv.Recipe.nvfp4(), key=jax.random.key(0))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(f, x, kern)
  text = out.getvalue()
  assert "u8[64,128]" in text  # Wgrad operand q(rht(x^T)): [K, T/2] codes.
  assert "bf16[256,64]" not in text and "f32[256,64]" not in text
  # Bytes per activation element: 0.5 (codes) + 1/16 (scales) vs 2 for bf16.
  assert 2 / (0.5 + 1 / 16) > 3.5


def _eqns_named(jaxpr, name, found=None):
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.params.get("name") == name:
      found.append(eqn)
    for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
      _eqns_named(sub, name, found)
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          _eqns_named(inner, name, found)
  return found


def _has_e4m3_cast(jaxpr):
  text = str(jaxpr)
  return "float8_e4m3fn" in text or "pallas_call" in text


def test_jaxpr_of_train_step_quantizes_all_three_gemms_of_quantized_layers():
  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nv.NVFP4Dense(K, name="hp")(x)
      return nv.NVFP4Dense(N, name="q")(x)
  rules = nv.PrecisionRules(rules=((r"^hp$", nv.Recipe.bf16()),))
  x = heavy(jax.random.key(0), (T, K))
  m = Two()
  params = m.init(jax.random.key(1), x)

  def loss(p, key):
    with nv.precision_rules(rules):
      return jnp.mean(m.apply(p, x, rngs={"nvfp4": key}) ** 2)

  step = jax.jit(jax.grad(loss))
  jaxpr = jax.make_jaxpr(step)(params, jax.random.key(2)).jaxpr
  # Only layer "q" is quantized: each region appears once.
  for name in ("nvfp4_quantize_x", "nvfp4_quantize_w", "nvfp4_quantize_dy"):
    eqns = _eqns_named(jaxpr, name)
    assert len(eqns) == 1, (name, len(eqns))
    assert _has_e4m3_cast(eqns[0].params["jaxpr"]), name
  # Each GEMM takes quantized operands and multiplies their bf16 block
  # values. Saved ones (the weight for Dgrad, q(rht(X^T))) arrive as uint8
  # codes + E4M3 scales; the operands used at once (q(X) and Fprop's weight,
  # q(dY), q(rht(dY^T))) as the block values their quantizer wrote
  # (`NVFP4Values`): bf16 outputs of the quantize regions themselves, not a
  # bf16 tensor from anywhere else.
  made_by = {name: set(map(id, _eqns_named(jaxpr, name)[0].outvars))
             for name in ("nvfp4_quantize_x", "nvfp4_quantize_w",
                          "nvfp4_quantize_dy")}
  values_from = {"nvfp4_fprop": ["nvfp4_quantize_x", "nvfp4_quantize_w"],
                 "nvfp4_dgrad": ["nvfp4_quantize_dy"],
                 "nvfp4_wgrad": ["nvfp4_quantize_dy"]}
  # The weight is quantized once, in its [in, out] layout (16x16 tiles are
  # symmetric): no transpose of it or of its codes anywhere.
  qw = _eqns_named(jaxpr, "nvfp4_quantize_w")[0]
  assert [v.aval.shape for v in qw.invars] == [(K, N)], qw.invars
  assert (K, N) in [v.aval.shape for v in qw.outvars
                    if v.aval.dtype == jnp.bfloat16]
  assert "transpose" not in str(qw.params["jaxpr"])
  assert "transpose" not in str(_eqns_named(jaxpr, "nvfp4_dgrad")[0].params[
      "jaxpr"])
  for name, sources in values_from.items():
    eqns = _eqns_named(jaxpr, name)
    assert len(eqns) == 1, (name, len(eqns))
    dtypes = {str(v.aval.dtype) for v in eqns[0].invars}
    want = {"bfloat16", "float32"} if name == "nvfp4_fprop" else {
        "uint8", "float8_e4m3fn", "bfloat16", "float32"}
    assert dtypes == want, (name, dtypes)
    vals = [v for v in eqns[0].invars if v.aval.dtype == jnp.bfloat16]
    assert [src for v in vals for src in sources
            if id(v) in made_by[src]] == sources, name
    inner = str(eqns[0].params["jaxpr"])
    assert "dot_general" in inner and "bf16[" in inner, name
  assert not _eqns_named(jaxpr, "bf16_fprop")  # Layer "hp" uses plain dots.


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dgrad_gemm_writes_dx_in_x_dtype(dtype):
  """dX leaves the Dgrad GEMM region in x's dtype: one rounding of its FP32
  accumulator, as the cast after it would be, so a GEMM kernel of our own
  writes dX in its epilogue instead of an FP32 copy of it."""
  x = heavy(jax.random.key(12), (T, K), dtype)
  kern = heavy(jax.random.key(13), (K, N)) * 0.05
  dims = (((1,), (0,)), ((), ()))
  dx = jax.grad(lambda x: nv.dot_general(
      x, kern, dims, recipe=nv.Recipe.nvfp4(),
      key=jax.random.key(0)).astype(jnp.float32).sum())
  jaxpr = jax.make_jaxpr(dx)(x).jaxpr
  (dgrad,) = _eqns_named(jaxpr, "nvfp4_dgrad")
  assert [v.aval.dtype for v in dgrad.outvars] == [jnp.dtype(dtype)]


def test_weight_in_kernel_layout_is_the_transposed_quantization(monkeypatch):
  """The weight quantized once in its `[in, out]` layout (the emulated
  GEMM's path) gives the operands, outputs and gradients of quantizing
  `kernel^T` for Fprop and transposing those codes for Dgrad."""
  from nvfp4_jax.ops.quantize import api as quantize_api
  from nvfp4_jax.sharding import per_shard
  from nvfp4_jax.training import dot_general as ops
  t, k, n = 64, 128, 96  # k != n: a transposed layout would not fit.
  x = heavy(jax.random.key(0), (t, k), jnp.bfloat16)
  w = heavy(jax.random.key(1), (k, n)) * 0.05
  # The operands: codes, scales and values, byte for byte.
  q, vals = quantize_api.quantize_with_values(w, block_2d=True)
  q_t = nv.quantize(w.T, block_2d=True)
  np.testing.assert_array_equal(q.codes, q_t.T.codes)
  np.testing.assert_array_equal(q.scales.view(jnp.uint8),
                                q_t.T.scales.view(jnp.uint8))
  np.testing.assert_array_equal(
      vals.T, nv.block_dequantize(q_t)[0].astype(jnp.bfloat16))
  # The layer, with and without the path.
  recipe = nv.Recipe.nvfp4()
  dims = (((1,), (0,)), ((), ()))

  def run():
    def loss(x, w):
      y = nv.dot_general(x, w, dims, recipe=recipe, key=jax.random.key(3))
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    (_, y), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
    return y, *g
  plan = ops.gemm_plan(platform=jax.default_backend(), cc=None)
  assert ops._weight_in_kernel_layout(recipe, plan, per_shard.WHOLE) == (
      plan.values)
  new = jax.jit(run)()
  monkeypatch.setattr(ops, "_weight_in_kernel_layout", lambda *a: False)
  old = jax.jit(run)()
  # Dgrad and Wgrad multiply the same values in the same layouts: equal.
  for a, b in zip(new[1:], old[1:]):
    np.testing.assert_array_equal(a, b)
  y_new, y_old = (np.asarray(y, np.float32) for y in (new[0], old[0]))
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(y_new, y_old)
  else:
    # Fprop multiplies the same products, `x @ V` instead of `x @ (V^T)^T`:
    # a GPU GEMM may sum the K FP32 terms in another order for the other
    # layout. Each sum is within K * 2^-24 * sum|terms| of the exact one,
    # then both round to bf16 (at most one bf16 ulp apart beyond that).
    qx, xv = quantize_api.quantize_with_values(x)
    alpha = np.float32(qx.amax) * np.float32(q.amax) / 2688.0**2
    terms = (np.abs(np.asarray(xv, np.float32))
             @ np.abs(np.asarray(vals, np.float32))) * alpha
    ulp = 2.0**(np.floor(np.log2(np.maximum(np.abs(y_old), 2.0**-126))) - 7)
    assert np.all(np.abs(y_new - y_old) <= 2 * k * 2.0**-24 * terms + ulp)


def test_data_parallel_layer_quantizes_its_whole_weight_in_place():
  """Where no mesh axis splits the weight (data parallelism, axes of size
  1), each device holds it whole and quantizes it as one device does (the
  kernel-layout pass: codes and Fprop's values at once, no dequantize
  before Fprop); an FSDP or tensor-parallel split gathers codes instead."""
  from jax.sharding import AbstractMesh
  from nvfp4_jax.sharding import per_shard
  from nvfp4_jax.training import dot_general as ops
  mesh = AbstractMesh((2, 1, 1), ("data", "fsdp", "model"))
  split = AbstractMesh((1, 2, 1), ("data", "fsdp", "model"))
  recipe = nv.Recipe.nvfp4()
  plan = ops.gemm_plan(platform=jax.default_backend(), cc=None)
  dp = per_shard.Shard(nv.LinearSharding(
      mesh=mesh, tokens=("data", "fsdp"), fsdp="fsdp"))
  fsdp = per_shard.Shard(nv.LinearSharding(
      mesh=split, tokens=("data", "fsdp"), fsdp="fsdp"))
  assert dp.whole_w and not fsdp.whole_w
  assert ops._weight_in_kernel_layout(recipe, plan, dp) == (
      ops._weight_in_kernel_layout(recipe, plan, per_shard.WHOLE))
  assert not ops._weight_in_kernel_layout(recipe, plan, fsdp)
  assert not ops._weight_kernel_layout_native(recipe, plan, fsdp)


def test_fsdp_splits_a_row_parallel_kernel_along_in_without_tensor_parallelism():
  """FSDP splits the kernel's `in` (its major dimension) unless tensor
  parallelism takes it: a row-parallel layer (`attn/out`, `mlp/down`) on a
  `model` axis of one device is split like any other, so its gradient's
  reduce-scatter writes shards in the parameters' layout (split along
  `out`, XLA transposed the FP32 master weights and moments for each
  update: BENCHMARKS.md, "The largest model on 4 GPUs"); with `model` of
  two devices `out` is split, `fsdp` beside `model`."""
  from jax.sharding import AbstractMesh
  from jax.sharding import PartitionSpec as P
  fsdp = AbstractMesh((1, 4, 1), ("data", "fsdp", "model"))
  tp = AbstractMesh((1, 2, 2), ("data", "fsdp", "model"))
  # The axes splitting each kernel dimension (a size-1 `model` axis may
  # stand beside `fsdp`: it splits nothing).
  split = lambda spec: tuple(
      tuple(a for a in ((e,) if isinstance(e, str) else e or ())
            if fsdp.shape[a] > 1) for e in spec)
  for path in ("blocks_0/attn/out", "blocks_0/mlp/down", "blocks_0/mlp/up"):
    s = nv.MeshRules(mesh=fsdp).linear(path)
    assert s.fsdp_dim == 0 and split(s.kernel_spec) == (("fsdp",), ()), path
    assert split(nv.MeshRules(mesh=fsdp).param_spec(
        path + "/kernel", (64, 32))) == (("fsdp",), ()), path
  row = nv.MeshRules(mesh=tp).linear("blocks_0/mlp/down")
  assert row.tensor == "row" and row.model_splits_in
  assert (row.fsdp_dim, row.kernel_spec) == (1, P("model", "fsdp"))
  col = nv.MeshRules(mesh=tp).linear("blocks_0/mlp/up")
  assert (col.fsdp_dim, col.kernel_spec) == (0, P("fsdp", "model"))


def test_dense_general_and_einsum_via_dot_general_cls():
  x = heavy(jax.random.key(0), (2, 16, 4, 16))
  dg = nn.DenseGeneral((3, 16), axis=(-2, -1),
                       dot_general_cls=nv.NVFP4DotGeneral)
  params = dg.init(jax.random.key(1), x)
  y = dg.apply(params, x)
  ref = nn.DenseGeneral((3, 16), axis=(-2, -1)).apply(params, x)
  assert y.shape == ref.shape == (2, 16, 3, 16)
  rel = jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)
  assert 1e-4 < rel < 0.2  # Quantized, but close.
  es = nv.NVFP4Einsum((64, 32), "btk,kn->btn")
  xe = heavy(jax.random.key(2), (2, 16, 64))
  pe = es.init(jax.random.key(3), xe)
  ye = es.apply(pe, xe)
  ref = nn.Einsum((64, 32), "btk,kn->btn").apply(pe, xe)
  assert 1e-4 < jnp.linalg.norm(ye - ref) / jnp.linalg.norm(ref) < 0.2


def test_leading_dims_flatten_into_tokens():
  x = heavy(jax.random.key(0), (2, 3, 16, K))
  layer = nv.NVFP4Dense(N, recipe=nv.Recipe.nvfp4(stochastic_rounding=False))
  params = layer.init(jax.random.key(1), x)
  y = layer.apply(params, x)
  y2 = layer.apply(params, x.reshape(-1, K)).reshape(y.shape)
  np.testing.assert_array_equal(y, y2)


def test_contraction_not_multiple_of_16_names_layer_path():
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nv.NVFP4Dense(N, name="proj")(x)
  x = jnp.ones((T, 40))
  with pytest.raises(ValueError, match=r"proj.*K.*40.*bf16"):
    M().init(jax.random.key(0), x)


def test_batched_dot_general_is_refused():
  a = jnp.ones((2, 16, 16))
  with pytest.raises(NotImplementedError, match="batched"):
    nv.dot_general(a, a, (((2,), (1,)), ((0,), (0,))), recipe=nv.Recipe.nvfp4())


def test_recipe_validation():
  with pytest.raises(ValueError, match="same format"):
    nv.Recipe(fprop_x=nv.Operand(format="nvfp4"))
  with pytest.raises(ValueError, match="both Wgrad operands"):
    r = nv.Recipe.nvfp4()
    r.replace(wgrad_x=nv.Operand(format="nvfp4"))
  with pytest.raises(ValueError, match="unknown format"):
    nv.Operand(format="fp4")
  with pytest.raises(ValueError, match="unknown recipe"):
    nv.Recipe.from_name("int4")
  assert nv.Recipe.from_name("mxfp8") == nv.Recipe.mxfp8()
  fwd = nv.Recipe.bf16_forward()
  assert fwd.gemm_format("fprop") == "bf16" and fwd.gemm_format("wgrad") == "nvfp4"
  off = nv.Recipe.nvfp4(rht=False, stochastic_rounding=False,
                        two_d_weights=False)
  assert not off.wgrad_x.rht and not off.needs_key and not off.fprop_w.block_2d


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "bf16_forward"])
def test_other_recipes_run_and_train_direction(name):
  recipe = nv.Recipe.from_name(name)
  x = heavy(jax.random.key(0), (T, K))
  kern = jax.random.normal(jax.random.key(1), (K, 64)) * 0.1
  f = lambda w: jnp.sum(nv.dot_general(
      x, w, (((1,), (0,)), ((), ())), recipe=recipe,
      key=jax.random.key(2)) ** 2)
  g = jax.grad(f)(kern)
  g_ref = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(kern)
  cos = jnp.sum(g * g_ref) / (jnp.linalg.norm(g) * jnp.linalg.norm(g_ref))
  assert cos > 0.9


def test_nnx_linear_matches_linen_and_keeps_state():
  rngs = nnx.Rngs(params=0, nvfp4=1)
  lin = nv.NVFP4Linear(K, N, recipe=nv.Recipe.bf16(), rngs=rngs)
  ref = nnx.Linear(K, N, rngs=nnx.Rngs(params=0))
  x = heavy(jax.random.key(0), (T, K))
  np.testing.assert_array_equal(lin(x), ref(x))
  assert jax.tree.structure(nnx.state(ref, nnx.Param)) == jax.tree.structure(
      nnx.state(lin, nnx.Param))
  q = nv.NVFP4Linear(K, N, rngs=rngs)

  @nnx.jit
  def grads(model, x):
    return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  g1 = grads(q, x)
  g2 = grads(q, x)  # The stream advanced: a new SR key.
  assert np.any(np.asarray(g1["kernel"][...] != g2["kernel"][...]))
