"""Auto mode (`jax.jit` shardings on the user's mesh) with the Pallas
kernels per shard: the dense layer's quantizers and the row gather."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd
from conftest import make_heavy_tailed
from mesh_checks.common import assert_same_q, check_within, gemm_bound
from mesh_checks.dot_general import layer_operands


def no_f32_gather_of(compiled, shapes, what):
  """No all-gather whose FP32 result holds as many elements as a tensor of
  one of `shapes` (a quantizer's input gathered whole, in any layout) in
  the compiled program."""
  sizes = {int(np.prod(sh)) for sh in shapes}
  bad = []
  for line in compiled.as_text().splitlines():
    if " all-gather(" not in line:
      continue
    for dims in re.findall(r"f32\[([0-9,]*)\]", line.split("all-gather(")[0]):
      if int(np.prod([int(d) for d in dims.split(",") if d])) in sizes:
        bad.append(line.strip()[:160])
  assert not bad, f"{what}: the quantizer's input is gathered: {bad}"


def check_auto_gather_rows():
  """Auto mode with the row gather kernel (`nvfp4_jax.ops.gather_rows`,
  interpreted on CPU): under `jax.jit` shardings each device gathers the
  rows of its shard of the index (`sharded.gather_per_shard`), so the result
  is split as the index is and equals the whole gather bit for bit; the
  compiled program runs the kernel on `[M / 8, D]` (off, on the whole
  `[M, D]`)."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.gather_rows.api import gather_rows  # pylint: disable=g-import-not-at-top
  m = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
  x = jnp.asarray(make_heavy_tailed((96, 48), seed=5)).astype(jnp.bfloat16)
  index = jnp.asarray(np.random.RandomState(0).permutation(128) % 100,
                      jnp.int32)           # Rows 96..99 name none: zeros.
  rows = NamedSharding(m, P("batch", None))
  split = NamedSharding(m, P("batch"))
  f = jax.jit(lambda x, i: gather_rows(x, i, implementation="pallas"),
              in_shardings=(rows, split))
  compiled = f.lower(x, index).compile()
  got = compiled(jax.device_put(x, rows), jax.device_put(index, split))
  want = gather_rows(x, index, implementation="xla")
  assert np.array_equal(np.asarray(got, np.float32),
                        np.asarray(want, np.float32)), "auto gather_rows"
  assert got.sharding.is_equivalent_to(NamedSharding(m, P("batch", None)), 2)
  hlo = compiled.as_text()
  assert "bf16[16,48]" in hlo, "the kernel's local shape"
  print("  auto gather_rows on batch=8: equal, split as the index")


def check_auto_kernels_quick():
  """Auto mode (`jax.jit` in_shardings on the user's mesh) with the Pallas
  kernels (interpreted on CPU): the pair quantizer of dY (stochastic
  rounding, RHT'd Wgrad operand), tokens split 8 ways over the user's
  ("batch", "fsdp"), runs per shard through `custom_partitioning`: codes,
  scales and amaxes equal the unsharded kernel's bit for bit, and the
  compiled program gathers no FP32 dY (with `spmd.AUTO_PARTITION` off XLA
  gathers it, as the opaque kernel needs the whole tensor)."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  m = jax.make_mesh((4, 2), ("batch", "fsdp"),
                    axis_types=(AxisType.Auto,) * 2)
  dy = jnp.asarray(make_heavy_tailed((128, 64), seed=3))
  r = nv.Recipe.nvfp4()
  keys = r.operand_keys(jax.random.key(7))

  def f(dy):
    return nv.quantize_pair(dy, r.dgrad_dy, r.wgrad_dy,
                            key_row=keys["dgrad_dy"], key_t=keys["wgrad_dy"],
                            implementation="pallas")
  split = NamedSharding(m, P(("batch", "fsdp"), None))
  compiled = jax.jit(f, in_shardings=split).lower(dy).compile()
  no_f32_gather_of(compiled, [(128, 64)], "pair kernel")
  got = compiled(jax.device_put(dy, split))
  want = jax.jit(f)(dy)
  for g, w, what in zip(got, want, ("row", "wgrad")):
    assert_same_q(g, w, f"auto-partitioned pair kernel ({what})")
  assert got[0].codes.sharding.is_equivalent_to(split, 2), got[0].codes.sharding
  ops = [c.op for c in shd.collectives(compiled) if not c.trivial]
  print(f"  auto pair kernel (SR, RHT) on batch x fsdp: equal; collectives "
        f"{ops}")
  # 64 tokens over 8 devices would cut the Wgrad operand's 16-token blocks:
  # the minor axis is dropped, 4 shards of 16 tokens (each replicated over
  # "fsdp"), still the whole tensor's bytes.
  small = dy[:64]
  compiled = jax.jit(f, in_shardings=split).lower(small).compile()
  got = compiled(jax.device_put(small, split))
  for g, w, what in zip(got, jax.jit(f)(small), ("row", "wgrad")):
    assert_same_q(g, w, f"pair kernel, 8-token shards ({what})")
  want_split = NamedSharding(m, P("batch", None))
  assert got[0].codes.sharding.is_equivalent_to(want_split, 2), (
      got[0].codes.sharding)
  print(f"  8-token shards: run on {got[0].codes.sharding.spec}, equal")
  # custom_partitioning has no batching rule: a vmapped kernel runs the
  # kernel vmapped, unpartitioned (`spmd._batchable`), with the same bytes.
  stack = dy[:64].reshape(2, 32, 64)
  got = jax.vmap(jax.jit(f))(stack)
  for i in range(2):
    for g, w, what in zip(jax.tree.map(lambda a, i=i: a[i], got),
                          jax.jit(f)(stack[i]), ("row", "wgrad")):
      assert_same_q(g, w, f"vmapped pair kernel {i} ({what})")
  print("  vmap(jit(pair kernel)): equal")


def check_auto_kernels():
  """`nv.dot_general` (NVFP4 recipe: SR on dY, RHT on the Wgrad operands,
  16x16 weight tiles) in auto mode with the Pallas kernels (interpreted on
  CPU), data-sharded activations and an FSDP weight on the user's mesh
  ("batch" x "fsdp", 4 x 2): the quantizers run per shard
  (`custom_partitioning`), so Fprop's Y and Dgrad's dX, whose contractions
  are not split, equal the unsharded op bit for bit; the weight gradient
  sums the token shards in another order, within `gemm_bound`. The
  compiled program gathers neither X nor dY in FP32. Also the Wgrad
  quantizer alone on a 2-D split (transposed result), and the values
  GEMM's and the native FP4 GEMM's per-shard rule
  (`sharded.matmul_per_shard`: the Mosaic GPU kernel's on Hopper, Triton's
  and cuDNN's on Blackwell) around stand-in kernels: per shard, with the
  XLA fallback for a shard the kernel turns down, equal to the whole
  GEMM."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  b, s, k, n = 8, 16, 64, 96
  t = b * s
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1)).reshape(b, s, k)
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3)).reshape(b, s, n)
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()
  dn = (((2,), (0,)), ((), ()))

  def f(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.dot_general(x, w, dn, recipe=recipe,
                                                 key=key), x, w)
    return (y, *vjp(dy))
  m = jax.make_mesh((4, 2), ("batch", "fsdp"),
                    axis_types=(AxisType.Auto,) * 2)
  xs, ws = P(("batch", "fsdp")), P("fsdp", None)
  with nv.default_implementation("pallas"):
    y0, dx0, dw0 = jax.jit(f)(x, w, dy)
    fn = jax.jit(f, in_shardings=tuple(NamedSharding(m, p)
                                       for p in (xs, ws, xs)),
                 out_shardings=tuple(NamedSharding(m, p)
                                     for p in (xs, xs, ws)))
    compiled = fn.lower(x, w, dy).compile()
    y, dx, dw = compiled(x, w, dy)
  for what, g, r in (("y", y, y0), ("dx", dx, dx0)):
    diff = int(np.sum(np.asarray(g) != np.asarray(r)))
    assert diff == 0, f"auto {what}: {diff} elements differ"
  qx, qxt, qdy, qdyt, _ = layer_operands(recipe, x.reshape(t, k), w,
                                    dy.reshape(t, n), key)
  del qx, qdy
  check_within(dw, dw0, gemm_bound(qxt, qdyt, t), "dw")
  no_f32_gather_of(compiled, [(t, k), (t, n)], "auto dot_general")
  summary = {}
  for c in shd.collectives(compiled):
    if not c.trivial:
      op = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
      summary[op] = summary.get(op, 0) + c.result_bytes
  print(f"  auto kernels data+fsdp: y, dx exact; collectives (bytes per "
        f"device): {summary}")
  # The Wgrad quantizer alone (SR, RHT) with both dimensions split: tokens
  # over "batch", features over "fsdp"; its result is split transposed.
  split = NamedSharding(m, P("batch", "fsdp"))
  g = jax.jit(lambda a: nv.quantize_rht_t(a, rounding="stochastic", key=key,
                                          implementation="pallas"),
              in_shardings=split)
  compiled = g.lower(dy.reshape(t, n)).compile()
  no_f32_gather_of(compiled, [(t, n)], "quantize_rht_t")
  got = compiled(jax.device_put(dy.reshape(t, n), split))
  want = jax.jit(lambda a: nv.quantize_rht_t(
      a, rounding="stochastic", key=key, implementation="pallas"))(
          dy.reshape(t, n))
  assert_same_q(got, want, "auto quantize_rht_t")
  assert got.codes.sharding.is_equivalent_to(
      NamedSharding(m, P("fsdp", "batch")), 2), got.codes.sharding
  print("  auto quantize_rht_t (SR) on batch x fsdp (2-D split): equal")
  # The values GEMM's per-shard rule (the Mosaic GPU kernel's on Hopper;
  # here around XLA's GEMM, standing for it): rows split as va's, columns
  # as vb's N, a split K gathered; each shard's output is the whole one's.
  from nvfp4_jax.ops.block_scaled_matmul import api as bsm  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul.reference import _values_matmul_xla  # pylint: disable=g-import-not-at-top
  va = jnp.asarray(make_heavy_tailed((128, 64), seed=4), jnp.bfloat16)
  vb = jnp.asarray(make_heavy_tailed((64, 96), seed=5), jnp.bfloat16)
  alpha = jnp.float32(0.37)
  seen = []

  def kernel(va, vb, alpha, *, small_ok, **kw):
    seen.append(va.shape)
    if not small_ok and va.shape[0] < 128:
      raise NotImplementedError("too small")
    return _values_matmul_xla(va, vb, alpha, **kw)
  want = jax.jit(functools.partial(_values_matmul_xla, out_dtype=jnp.float32,
                                   vb_kn=True))(va, vb, alpha)
  for small_ok in (True, False):
    seen.clear()
    g = jax.jit(lambda va, vb, a: bsm.VALUES_MATMUL.per_shard(
        functools.partial(kernel, small_ok=small_ok), va, vb, a,
        out_dtype=jnp.float32, vb_kn=True),
                in_shardings=(NamedSharding(m, P("batch", "fsdp")),
                              NamedSharding(m, P(None, "fsdp")),
                              NamedSharding(m, P())))(va, vb, alpha)
    assert (32, 64) in seen, seen  # A shard: 128 rows / 4, K gathered.
    assert g.sharding.is_equivalent_to(
        NamedSharding(m, P("batch", "fsdp")), 2), g.sharding
    diff = int(np.sum(np.asarray(g) != np.asarray(want)))
    assert diff == 0, f"values GEMM per shard: {diff} elements differ"
  print(f"  values GEMM per shard: {g.sharding.spec}, equal (kernel and "
        f"fallback)")
  # A native FP4 GEMM's rule (Triton, cuDNN on Blackwell) on quantized
  # operands, around the reference standing for the kernel: X's rows over
  # "batch", the weight's N over "fsdp".
  from nvfp4_jax.ops.block_scaled_matmul.reference import _matmul_xla  # pylint: disable=g-import-not-at-top
  qa = nv.quantize(x.reshape(t, k))
  qb = nv.quantize(w.T, block_2d=True)

  def native(a, b, **kw):
    seen.append(a.shape)
    return _matmul_xla(a, b, **kw)

  def placed(q, spec):
    return jax.tree.map(lambda l: NamedSharding(m, spec if l.ndim else P()),
                        q)
  seen.clear()
  g = jax.jit(lambda a, b: bsm.BLOCK_SCALED_MATMUL.per_shard(
      native, a, b, out_dtype=jnp.float32),
              in_shardings=(placed(qa, P("batch", None)),
                            placed(qb, P("fsdp", None))))(qa, qb)
  want = jax.jit(functools.partial(_matmul_xla, out_dtype=jnp.float32))(qa,
                                                                      qb)
  assert (t // 4, k) in seen, seen
  assert g.sharding.is_equivalent_to(NamedSharding(m, P("batch", "fsdp")),
                                     2), g.sharding
  diff = int(np.sum(np.asarray(g) != np.asarray(want)))
  assert diff == 0, f"native GEMM per shard: {diff} elements differ"
  print(f"  native FP4 GEMM rule per shard: {g.sharding.spec}, equal")
