"""The grouped (MoE) ops and the `NVFP4MoE` layer on a mesh: auto mode
per shard, expert parallelism and its exchanges."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from conftest import make_heavy_tailed
from mesh_checks.common import U, check_within
from mesh_checks.auto import no_f32_gather_of


def _moe_case(m_rows=128, k=32, n=32):
  """Tokens sorted by expert, groups on 16-row boundaries (one empty), the
  experts' weights and dY of a small grouped GEMM."""
  gs = jnp.array([48, 0, 32, 48], jnp.int32)
  x = jnp.asarray(make_heavy_tailed((m_rows, k), seed=11))
  w = jnp.asarray(make_heavy_tailed((4, k, n), seed=12)) * 0.05
  dy = jnp.asarray(make_heavy_tailed((m_rows, n), seed=13))
  return gs, x, w, dy


def _wgrad_bound(x, dy, gs, recipe, key):
  """The derived bound (module docstring) on the Wgrad GEMM's result
  summed in another order: per expert `2 (n + 3) u alpha_e sum_t |a_t b_t|`
  over its tokens' exact block values."""
  from nvfp4_jax.ops.ragged_dot import api as rg  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_quantize import api as rq  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import expert_keys  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import per_expert_keys  # pylint: disable=g-import-not-at-top
  keys = expert_keys(recipe, per_expert_keys(key, gs.shape[0]))
  q = [jax.jit(lambda a, k: rq.quantize_tokens(
      a, gs, op, k, rht_size=recipe.rht_size,
      sign_vector=recipe.rht_sign_vector))(a, keys[name])
       for a, op, name in ((x, recipe.wgrad_x, "wgrad_x"),
                           (dy, recipe.wgrad_dy, "wgrad_dy"))]
  alpha = np.asarray(rg.group_alpha(*q), np.float64)
  va, vb = (np.abs(np.asarray(g.values, np.float64)) for g in q)
  ends = np.cumsum(np.asarray(gs))
  bound = np.zeros((gs.shape[0], va.shape[0], vb.shape[0]))
  for e, (lo, hi) in enumerate(zip(ends - np.asarray(gs), ends)):
    bound[e] = 2 * (hi - lo + 3) * U * alpha[e] * (va[:, lo:hi] @
                                                   vb[:, lo:hi].T)
  return bound


def _wgrad_operands(x, dy, gs, recipe, key):
  """The Wgrad operands `nv.ragged_dot` quantizes (codes, as it saves them)."""
  from nvfp4_jax.ops.ragged_quantize import api as rq  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import expert_keys  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import per_expert_keys  # pylint: disable=g-import-not-at-top
  keys = expert_keys(recipe, per_expert_keys(key, gs.shape[0]))
  return [rq.quantize_tokens(a, gs, op, keys[name], rht_size=recipe.rht_size,
                             sign_vector=recipe.rht_sign_vector, values=False,
                             codes=True)
          for a, op, name in ((x, recipe.wgrad_x, "wgrad_x"),
                              (dy, recipe.wgrad_dy, "wgrad_dy"))
          if a is not None]


def _same_grouped(got, want, what):
  for field in ("data", "scales", "amax"):
    u, v = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
    if u.dtype.itemsize == 1:
      u, v = u.view(np.uint8), v.view(np.uint8)
    diff = int(np.sum(u != v))
    assert diff == 0, f"{what}: {diff} {field} differ"


def _whole_and_token_split(f, m, x, w, dy):
  """`f(x, w, dy)` with the Pallas kernels, jitted whole and under plain
  `jax.jit` shardings (auto mode) with `x` and `dy` split along the tokens
  over `("batch", "fsdp")`: `(whole result, split result, the compiled
  split program)`."""
  tok, rep = (NamedSharding(m, P(("batch", "fsdp"), None)),
              NamedSharding(m, P()))
  with nv.default_implementation("pallas"):
    want = jax.jit(f)(x, w, dy)
    compiled = jax.jit(f, in_shardings=(tok, rep, tok)).lower(
        x, w, dy).compile()
    return want, compiled(x, w, dy), compiled


def check_auto_moe_quick(backward=False):
  """`nv.ragged_dot` (the NVFP4 recipe: SR on dY, RHT'd Wgrad operands,
  16x16 expert tiles) in auto mode with the Pallas quantizers (interpreted
  on CPU), the sorted tokens split 8 ways over the user's ("batch",
  "fsdp"): the grouped quantizers run per shard (`QUANTIZE_ROWS`,
  `TOKEN_BLOCK_AMAX`, `QUANTIZE_TOKENS` through `spmd.blockwise`, each
  row's or token block's group constants split with it), so Y equals the
  unsharded op bit for bit, and so does the Wgrad operand of dY (the op's
  token quantizer, SR after the RHT, called alongside). The compiled
  program gathers neither X nor dY in FP32 (with `spmd.AUTO_PARTITION` off
  XLA gathers both around the opaque kernels). With `backward` (the slow
  tier): the op's gradients too, dX bit for bit, dW (which sums the token
  shards: XLA's partition of the reference GEMM) within the derived bound
  (`_wgrad_bound`), and both Wgrad operands."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  gs, x, w, dy = _moe_case()
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()

  def f(x, w, dy):
    op = lambda x, w: nv.ragged_dot(x, w, gs, recipe=recipe, key=key,
                                    align="assume")
    if not backward:
      return (op(x, w), _wgrad_operands(None, dy, gs, recipe, key))
    y, vjp = jax.vjp(op, x, w)
    return (y, _wgrad_operands(x, dy, gs, recipe, key), *vjp(dy))
  m = jax.make_mesh((4, 2), ("batch", "fsdp"),
                    axis_types=(AxisType.Auto,) * 2)
  want, got, compiled = _whole_and_token_split(f, m, x, w, dy)
  diff = int(np.sum(np.asarray(got[0]) != np.asarray(want[0])))
  assert diff == 0, f"auto ragged_dot y: {diff} elements differ"
  for what, g, r in zip(("dy", "x") if not backward else ("x", "dy"),
                        got[1], want[1]):
    _same_grouped(g, r, f"auto Wgrad operand of {what}")
    # Split along the tokens, transposed.
    assert g.data.sharding.is_equivalent_to(
        NamedSharding(m, P(None, ("batch", "fsdp"))), 2), g.data.sharding
  if backward:
    diff = int(np.sum(np.asarray(got[2]) != np.asarray(want[2])))
    assert diff == 0, f"auto ragged_dot dx: {diff} elements differ"
    check_within(got[3], want[3], _wgrad_bound(x, dy, gs, recipe, key),
                 "auto ragged_dot dw")
  no_f32_gather_of(compiled, [x.shape, dy.shape], "auto ragged_dot")
  print(f"  auto ragged_dot (SR, RHT{', backward' if backward else ''}) on "
        f"batch x fsdp: equal; no token gathered")


def check_auto_moe():
  """Auto mode on the grouped (MoE) ops, the slow tier.

  - `check_auto_moe_quick` with the backward pass (dX bit for bit, dW
    within the derived bound, both Wgrad operands bit for bit).
  - The grouped GEMMs' per-shard rules (`ragged_dot.sharded.grouped_matmul_per_shard`:
    the Mosaic GPU kernels' on Hopper, Triton's on Blackwell) around
    stand-in kernels (the reference), which record each shard's shape and
    turn shards down in a second run (the reference runs them then):
    Fprop/Dgrad with the rows split (groups straddling shards: each
    shard's own group sizes; a split that does not divide the rows drops
    its minor axis) and N split, equal to the whole GEMM; Wgrad with K
    and N split and the tokens gathered, equal to the whole GEMM; the
    same on codes.
  - The grouped quantizers on a 2-D split (`_check_grouped_quantizers_2d`).
  - MX: the MXFP4 op, and the native GEMM rule on MX operands
    (`_check_auto_mx`).
  - The `NVFP4MoE` layer with the Pallas quantizers, tokens split over
    "batch" x "fsdp" and its expert weights over "batch" along E: the
    experts' weights are quantized per shard (the kernel sees `E / 4`
    experts), and the expert weights' gradients equal one device's bit for
    bit (inputs and router weights on coarse grids, so that the FP32
    router's logits are exact in any shape and the routing is one
    device's on every host). The router's gradient sums over token shards
    (as `check_moe_expert_parallel` derives): y and the router's gradient
    within those bounds. The layer's dispatch (a gather
    by the routing's sort) leaves the token copies replicated, so their
    quantizers run whole on each device here; the op alone, on sorted
    tokens split by the user, runs them per shard (above).
  """
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import api as rg  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_quantize import api as rq  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import reference as rref  # pylint: disable=g-import-not-at-top
  check_auto_moe_quick(backward=True)
  m = jax.make_mesh((4, 2), ("batch", "fsdp"),
                    axis_types=(AxisType.Auto,) * 2)
  sh = lambda *spec: NamedSharding(m, P(*spec))
  gs, x, w, _ = _moe_case()
  va = x.astype(jnp.bfloat16)
  vb = w.astype(jnp.bfloat16)
  alpha = jnp.asarray([0.5, 1.0, 0.25, 2.0], jnp.float32)
  seen = []

  def stand_in(ref_fn, small_ok, whole=None):
    def kernel(*args, **kw):
      seen.append(args[0].shape)
      if not small_ok and args[0].shape != whole:
        raise NotImplementedError("a shard")
      return ref_fn(*args, **kw)
    return kernel
  cases = (
      ("values", rg.RAGGED_VALUES_MATMUL, rref.ragged_values_matmul,
       (va, vb), (sh("batch", None), sh(None, None, "fsdp")),
       dict(vb_layout="kn"), P("batch", "fsdp"), (32, 32)),
      ("values nk", rg.RAGGED_VALUES_MATMUL, rref.ragged_values_matmul,
       (va, jnp.swapaxes(vb, 1, 2)), (sh("batch", None),
                                      sh(None, "fsdp", None)),
       dict(vb_layout="nk"), P("batch", "fsdp"), (32, 32)),
      ("values_t", rg.RAGGED_VALUES_MATMUL_T, rref.ragged_values_matmul_t,
       (va.T, dy_t := jnp.asarray(make_heavy_tailed((32, 128), seed=14),
                                  jnp.bfloat16)),
       (sh("batch", "fsdp"), sh("fsdp", None)), dict(tokens_last=True),
       P(None, "batch", "fsdp"), (8, 128)),
  )
  for name, op, ref_fn, operands, shardings, kw, out_spec, shard in cases:
    want = jax.jit(lambda a, b, g, al, ref_fn=ref_fn, kw=kw: ref_fn(
        a, b, g, al, **kw))(*operands, gs, alpha)
    for small_ok in (True, False):
      seen.clear()
      got = jax.jit(lambda a, b, g, al, op=op, ref_fn=ref_fn, kw=kw,
                    small_ok=small_ok: op.per_shard(
                        stand_in(ref_fn, small_ok, operands[0].shape), a, b,
                        g, al, **kw),
                    in_shardings=(*shardings, sh(), sh()))(*operands, gs,
                                                           alpha)
      assert shard in seen, (name, shard, seen)
      assert got.sharding.is_equivalent_to(NamedSharding(m, out_spec),
                                           got.ndim), (name, got.sharding)
      diff = int(np.sum(np.asarray(got) != np.asarray(want)))
      assert diff == 0, f"{name} per shard: {diff} elements differ"
    print(f"  grouped GEMM {name} per shard: {out_spec}, equal (kernel and "
          f"fallback)")
  del dy_t
  # 100 rows in groups of 30, 41 and 20 (9 rows past them), asked to split
  # 8 ways: 8 does not divide 100, so the minor axis is dropped (4 shards
  # of 25 rows, no padding), each shard with its own groups.
  va100 = jnp.asarray(make_heavy_tailed((100, 32), seed=15), jnp.bfloat16)
  gs100 = jnp.array([30, 41, 20, 0], jnp.int32)
  want = rref.ragged_values_matmul(va100, vb, gs100, alpha)
  seen.clear()
  got = jax.jit(lambda a, b, g, al: rg.RAGGED_VALUES_MATMUL.per_shard(
      stand_in(rref.ragged_values_matmul, True),
      jax.lax.with_sharding_constraint(a, sh(("batch", "fsdp"), None)), b,
      g, al, vb_layout="kn"), in_shardings=(sh("batch", None), sh(), sh(),
                                            sh()))(va100, vb, gs100, alpha)
  assert (25, 32) in seen, seen
  diff = int(np.sum(np.asarray(got) != np.asarray(want)))
  assert diff == 0, f"uneven grouped GEMM per shard: {diff} elements differ"
  print("  grouped GEMM on 100 rows asked 8 ways: 4 shards of 25, equal")
  # On codes (the native FP4 kernels' rule): X's rows over "batch", the
  # experts' N over "fsdp".
  qx = rq.quantize_rows(x, gs, nv.Recipe.nvfp4().fprop_x, None,
                        values=False, codes=True)
  qw = rq.quantize_experts(jnp.swapaxes(w, 1, 2), nv.Recipe.nvfp4().fprop_w,
                           None, values=False)
  args = (qx.data, qx.scales, qw.data, qw.scales)
  want = jax.jit(rref.ragged_codes_matmul)(*args, gs, alpha)
  seen.clear()
  got = jax.jit(lambda *a: rg.RAGGED_CODES_MATMUL.per_shard(
      stand_in(rref.ragged_codes_matmul, True), *a),
                in_shardings=(sh("batch", None), sh("batch", None),
                              sh(None, "fsdp", None), sh(None, "fsdp", None),
                              sh(), sh()))(*args, gs, alpha)
  assert (32, 16) in seen, seen
  diff = int(np.sum(np.asarray(got) != np.asarray(want)))
  assert diff == 0, f"codes GEMM per shard: {diff} elements differ"
  print(f"  grouped codes GEMM per shard: {got.sharding.spec}, equal")
  _check_grouped_quantizers_2d(m)
  _check_auto_mx(m)
  _check_auto_moe_layer(m)


def _check_auto_mx(m):
  """MX in auto mode: the MXFP4 recipe's `nv.ragged_dot` (its quantizers
  pure jnp, which XLA partitions itself; the grouped GEMMs per shard) on
  tokens split over "batch" x "fsdp": Y and dX equal one device bit for
  bit, no token gathered. And the native FP4/FP8 GEMM kernels' rule
  (`BLOCK_SCALED_MATMUL.per_shard`: Triton, cuDNN on Blackwell) on
  `MXArray` operands around the reference standing for the kernel: per
  shard, equal to the whole GEMM."""
  import functools as ft  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul import api as bsm  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul.reference import _matmul_xla  # pylint: disable=g-import-not-at-top
  gs, x, w, dy = _moe_case()
  key = jax.random.key(7)

  def f(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
        x, w, gs, recipe="mxfp4", key=key, align="assume"), x, w)
    return (y, vjp(dy)[0])
  want, got, compiled = _whole_and_token_split(f, m, x, w, dy)
  for what, g, r in zip(("y", "dx"), got, want):
    diff = int(np.sum(np.asarray(g) != np.asarray(r)))
    assert diff == 0, f"auto mxfp4 ragged_dot {what}: {diff} elements differ"
  no_f32_gather_of(compiled, [x.shape, dy.shape], "auto mxfp4 ragged_dot")
  print("  auto mxfp4 ragged_dot on batch x fsdp: y, dx equal; no token "
        "gathered")
  a = jnp.asarray(make_heavy_tailed((128, 64), seed=1))
  b = jnp.asarray(make_heavy_tailed((96, 64), seed=2))
  for fmt in ("mxfp4", "mxfp8"):
    qa, qb = nv.quantize_mx(a, fmt), nv.quantize_mx(b, fmt)
    seen = []

    def native(a, b, **kw):
      seen.append(a.shape)
      return _matmul_xla(a, b, **kw)

    def placed(q, spec):
      return jax.tree.map(lambda l, spec=spec: NamedSharding(
          m, spec if l.ndim else P()), q)
    got = jax.jit(lambda a, b: bsm.BLOCK_SCALED_MATMUL.per_shard(
        native, a, b, out_dtype=jnp.float32), in_shardings=(
            placed(qa, P("batch", None)), placed(qb, P("fsdp", None))))(
                qa, qb)
    want = jax.jit(ft.partial(_matmul_xla, out_dtype=jnp.float32))(qa, qb)
    assert (32, 64) in seen, seen
    assert got.sharding.is_equivalent_to(
        NamedSharding(m, P("batch", "fsdp")), 2), got.sharding
    diff = int(np.sum(np.asarray(got) != np.asarray(want)))
    assert diff == 0, f"native {fmt} GEMM per shard: {diff} elements differ"
    print(f"  native {fmt} GEMM rule per shard: {got.sharding.spec}, equal")


def _check_grouped_quantizers_2d(m):
  """The grouped quantizers (Pallas, interpreted) on a 2-D split: tokens
  over "batch", features over "fsdp". Round-to-nearest keeps both splits
  (the token blocks' post-RHT amaxes max-reduced over "fsdp"); stochastic
  rounding gathers the features (the kernels number stream positions from
  the first column). Either way the bytes are the whole call's."""
  from nvfp4_jax.ops.ragged_quantize import api as rq  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import expert_keys  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training.ragged_dot import per_expert_keys  # pylint: disable=g-import-not-at-top
  gs, x, _, _ = _moe_case()
  recipe = nv.Recipe.nvfp4()
  keys = expert_keys(recipe, per_expert_keys(jax.random.key(3), 4))
  split = NamedSharding(m, P("batch", "fsdp"))
  cases = (("tokens RTNE", lambda a: rq.quantize_tokens(
      a, gs, recipe.wgrad_x, None, values=False, codes=True)),
           ("tokens SR", lambda a: rq.quantize_tokens(
               a, gs, recipe.wgrad_dy, keys["wgrad_dy"], values=False,
               codes=True)),
           ("rows RTNE", lambda a: rq.quantize_rows(
               a, gs, recipe.fprop_x, None, values=False, codes=True)),
           ("rows SR", lambda a: rq.quantize_rows(
               a, gs, recipe.dgrad_dy, keys["dgrad_dy"], values=False,
               codes=True)))
  for name, fn in cases:
    with nv.default_implementation("pallas"):
      want = jax.jit(fn)(x)
      compiled = jax.jit(lambda a, fn=fn: fn(a), in_shardings=split).lower(
          x).compile()
      got = compiled(x)
    _same_grouped(got, want, f"auto grouped quantizer, {name}")
    no_f32_gather_of(compiled, [x.shape], name)
    print(f"  grouped quantizer {name} on batch x fsdp: equal, codes "
          f"{got.data.sharding.spec}")


def _check_auto_moe_layer(m):
  """The `NVFP4MoE` part of `check_auto_moe`."""
  from nvfp4_jax.flax.moe import NVFP4MoE  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_quantize import pallas_triton as kernels  # pylint: disable=g-import-not-at-top
  d, t, num = 64, 128, 4
  # Tokens in multiples of 1/8 within +-4 and router weights in multiples of
  # 1/64 within +-1/2: each product is a multiple of 2^-9 below 2 and a
  # logit's 64 terms sum below 128, 16 significant bits, so the FP32 router
  # is exact in any order and shape. The routing is then one device's on
  # every host, whatever its dot library (YNNPACK's FP32 dots, the default
  # on AVX-512 hosts, round differently by the shard's shape: the routing
  # weights moved in the last bit, SR codes of the down projection's dY
  # flipped, 30 of its 8192 weight gradients differed on the H200 host).
  x = jnp.clip(jnp.round(jax.random.normal(jax.random.key(0),
                                           (8, t // 8, d)) * 8), -32, 32) / 8
  layer = NVFP4MoE(num_experts=num, hidden=32, top_k=2)
  params = layer.init(jax.random.key(1), x)["params"]
  params["router"] = jnp.clip(jnp.round(params["router"] * 64), -32, 32) / 64

  def loss(p, x):
    y, _ = layer.apply({"params": p}, x, rngs={"nvfp4": jax.random.key(2)},
                       mutable=["losses"])
    return jnp.sum(y * y), y
  grad = jax.value_and_grad(loss, has_aux=True)
  p_sh = jax.tree.map(lambda a: NamedSharding(
      m, P("batch") if a.ndim == 3 else P()), params)
  shapes, real = [], kernels.quantize_rows

  def recorded(x, *a, **kw):
    shapes.append(x.shape)
    return real(x, *a, **kw)
  with nv.default_implementation("pallas"):
    (_, y1), g1 = jax.jit(grad)(params, x)
    kernels.quantize_rows = recorded
    # Traced again with the recording kernel: the layer's inner jitted
    # functions keep their traces by argument types, which the shardings
    # of auto mode do not change.
    jax.clear_caches()
    try:
      (_, y2), g2 = jax.jit(lambda p, x: grad(p, x), in_shardings=(
          p_sh, NamedSharding(m, P(("batch", "fsdp")))))(params, x)
    finally:
      kernels.quantize_rows = real
  # The experts' weights ([E * rows, cols], 16x16 tiles) per shard.
  assert (num // 4 * d, 64) in shapes and (num // 4 * 32, d) in shapes, shapes
  for name in ("up", "down"):
    a = np.asarray(g1["experts"][name]["kernel"])
    b = np.asarray(g2["experts"][name]["kernel"])
    assert np.array_equal(a, b), f"auto moe {name} grad differs"
  logit_terms = np.abs(np.asarray(x).reshape(t, d)) @ np.abs(
      np.asarray(params["router"]))
  dz = 2 * d * U * logit_terms.max()
  out_max = float(np.abs(np.asarray(y1)).max()) + 1.0
  check_within(y2, y1, np.float64(2 * dz * out_max + 4 * U * out_max),
               "auto moe y")
  r1 = np.asarray(g1["router"])
  check_within(g2["router"], r1, np.float64(2 * t * U * t * np.abs(r1).max()),
               "auto moe router grad")
  print("  auto NVFP4MoE (tokens over batch x fsdp, experts over batch): "
        "expert weights quantized per shard, their gradients exact")


_MOE_WHOLE = {}  # (recipe, capacity factor) -> one device's params, results.


def check_moe_expert_parallel(expert_only: bool = False,
                              explicit: bool = True):
  """The MoE layer on an `expert` mesh equals one device.

  Expert parallel (`expert=8`, one NVFP4 expert per device, with a capacity
  that drops copies): every expert receives exactly the copies it gets on one
  device, in token order, so its quantized operands and its weight gradient
  are one device's bit for bit (checked with `==`). What is computed per
  token shard in another shape is the FP32 router (`[T/8, D] @ [D, E]` and
  its gradient, summed over the shards): its logits move by at most
  `2 D u sum_d |x_d r_d|`, a softmax weight by at most `k` times that
  (the top-k softmax's derivative is at most 1/2 per logit, 2 logits per
  token), so an output by `k * dz * max |expert output|`; the router's
  gradient sums N token terms in another order: `2 N u sum |terms|`,
  bounded here by `2 N u * N * max |term|` with the terms of the one-device
  gradient. A `data=2 x expert=4` mesh splits each expert's tokens over two
  data shards (each quantizes its own share), and so does `data=8` (each
  shard routes its tokens to its own copy of the experts): checked with
  every GEMM in high precision, within the same FP32 bounds.
  """
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training import moe  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.flax.moe import NVFP4MoE  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.sharding import MeshRules  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top
  d, t = 64, 128
  x = jax.random.normal(jax.random.key(0), (8, t // 8, d))
  cases = ((dict(expert=8), None, 0.5), (dict(data=2, expert=4), "bf16", None),
           (dict(data=8), "bf16", None))
  for sizes, recipe, cf in cases[:2] if expert_only else cases:
    layer = NVFP4MoE(num_experts=8, hidden=32, top_k=2, capacity_factor=cf,
                     recipe=recipe)

    def loss(p, x, layer=layer):
      y, st = layer.apply({"params": p}, x, rngs={"nvfp4": jax.random.key(2)},
                          mutable=["losses"])
      return jnp.sum(y * y) + st["losses"]["moe_aux_loss"][0], y
    grad = jax.value_and_grad(loss, has_aux=True)
    # The one-device layer runs no exchange (no mesh rules: every expert
    # here), so its parameters and results for this layer are computed once
    # per process, whatever `moe.EXCHANGE` and `moe.EXCHANGE_SLACK` are.
    if (recipe, cf) not in _MOE_WHOLE:
      params = layer.init(jax.random.key(1), x)["params"]
      _MOE_WHOLE[recipe, cf] = params, jax.jit(grad)(params, x)
    params, ((l1, y1), g1) = _MOE_WHOLE[recipe, cf]
    rules = MeshRules(mesh=make_mesh(**sizes))

    def sharded(p, x, rules=rules, grad=grad):
      with nv.mesh_rules(rules):
        return grad(p, x)
    (l2, y2), g2 = jax.jit(sharded)(params, x)
    # The exchange moves only the copies that exist (`moe.EXCHANGE`
    # "ragged"; on CPU devices `moe_exchange.ragged_all_to_all`'s
    # all-gather form),
    # or whole `[n, T_local * k, D]` buffers through `all_to_all`.
    jaxpr = str(jax.make_jaxpr(sharded)(params, x))
    buffers = [m for m in re.findall(r":\w+\[([\d,]+)\] = all_to_all",
                                     jaxpr) if m.count(",") == 2]
    ragged = moe.exchange_for("cpu") == "ragged"
    if "expert" in sizes:
      assert bool(buffers) == (not ragged), (buffers, moe.EXCHANGE)
    else:
      # Batch axes only: each shard routes and runs its own tokens
      # (`shard_map`), no token crosses devices.
      assert "shard_map" in jaxpr and "all_to_all" not in jaxpr, sizes
    logit_terms = np.abs(np.asarray(x).reshape(t, d)) @ np.abs(
        np.asarray(params["router"]))
    dz = 2 * d * U * logit_terms.max()
    out_max = float(np.abs(np.asarray(y1)).max()) + 1.0
    check_within(y2, y1, np.float64(2 * dz * out_max + 4 * U * out_max),
                 f"moe {sizes} cf={cf} y")
    r1 = np.asarray(g1["router"])
    check_within(g2["router"], r1, np.float64(2 * t * U * t * np.abs(r1).max()),
                 f"moe {sizes} cf={cf} router grad")
    for name in ("up", "down"):
      a = np.asarray(g1["experts"][name]["kernel"])
      b = np.asarray(g2["experts"][name]["kernel"])
      if recipe is None:
        assert np.array_equal(a, b), (sizes, cf, name)
      else:
        check_within(b, a, np.float64(2 * t * U * t * np.abs(a).max()),
                     f"moe {sizes} cf={cf} {name} grad")
    print(f"moe {sizes} recipe={recipe or 'nvfp4'} cf={cf}: loss "
          f"{float(l1):.6f} vs {float(l2):.6f}, max |dy| "
          f"{float(np.abs(np.asarray(y1) - np.asarray(y2)).max()):.3g}")
  if not explicit:
    return
  # The user's mesh under sharding in types (Explicit axes, the user's axis
  # name): the layer gathers its tokens and runs whole, as one device does
  # (the last layer above, bf16, dropless): the same bounds.
  explicit = jax.make_mesh((8,), ("batch",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(explicit):
    xs = jax.device_put(x, NamedSharding(explicit, P("batch")))
    (l3, y3), g3 = jax.jit(grad)(params, xs)
    assert jax.typeof(y3).sharding.spec[0] == "batch", jax.typeof(y3)
  check_within(y3, y1, np.float64(2 * dz * out_max + 4 * U * out_max),
               "moe explicit y")
  for name in ("up", "down"):
    a = np.asarray(g1["experts"][name]["kernel"])
    check_within(g3["experts"][name]["kernel"], a,
                 np.float64(2 * t * U * t * np.abs(a).max()),
                 f"moe explicit {name} grad")
  r1 = np.asarray(g1["router"])
  check_within(g3["router"], r1, np.float64(2 * t * U * t * np.abs(r1).max()),
               "moe explicit router grad")
  print(f"moe explicit batch=8: loss {float(l1):.6f} vs {float(l3):.6f}")


def check_ragged_all_to_all_model():
  """`moe_exchange.ragged_all_to_all`'s CPU form against the semantics JAX
  documents for `jax.lax.ragged_all_to_all` (slice `i` to device `i // per`,
  at the receiver's row `output_offsets[i]`), written out in NumPy: a 2 x 4 mesh
  exchanging over its second axis, two slices per receiver, empty slices
  included; rows nobody writes keep the output's."""
  from nvfp4_jax.training import moe_exchange  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  n, per, rows, out_rows = 4, 2, 8, 32
  rng = np.random.default_rng(0)
  ops = rng.normal(size=(8, rows, 3)).astype(np.float32)
  sizes = rng.integers(0, 2, (8, n * per)).astype(np.int32)
  offs = (np.cumsum(sizes, axis=1) - sizes).astype(np.int32)
  # Receiver rows: sender `e`'s slice `i` at `8 e + 4 (i % per)`.
  places = np.asarray([[8 * (d % 4) + 4 * (i % per) for i in range(n * per)]
                       for d in range(8)], np.int32)
  init = np.full((8, out_rows, 3), -1, np.float32)
  want = init.copy()
  for d in range(8):
    for i in range(n * per):
      dst = 4 * (d // 4) + i // per
      want[dst, places[d, i]:places[d, i] + sizes[d, i]] = ops[
          d, offs[d, i]:offs[d, i] + sizes[d, i]]
  spec = P(("data", "expert"))

  def body(o, out, of, sz, pl):
    return moe_exchange.ragged_all_to_all(o[0], out[0], of[0], sz[0], pl[0],
                                          sz[0], "expert", "cpu")[None]
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5,
                              out_specs=spec, check_vma=False))(
                                  *map(put, (ops, init, offs, sizes, places)))
  assert np.array_equal(np.asarray(got), want)
  print("ragged all-to-all model: equal")


def check_moe_expert_parallel_dense():
  """`check_moe_expert_parallel` with the buffered exchange
  (`moe.EXCHANGE = "buffered"`, the default on GPUs): the same results
  with each branch of its `lax.cond`.

  - `EXCHANGE_SLACK` 0.01: one row per peer, which no routing here fits,
    so the whole-buffer branch must run (a fast path taken anyway would
    drop copies: O(1) errors).
  - `EXCHANGE_SLACK` `n (rows - 1) / rows`: `rows - 1` rows per peer. On
    `expert=8` each device holds one expert and a token's top-2 copies go
    to two experts, so no device sends all its copies to one peer: the
    fast path runs (`data=2 x expert=4` too, unless all 32 copies of a
    device pick one device's two experts).
  The default (None: whole buffers, no `cond`, on every mesh) is
  `check_moe_expert_parallel_dense_default`.
  """
  rows = 16 * 2          # `check_moe_expert_parallel`: t / 8 tokens, top-2.
  _buffered_exchange((0.01, 8 * (rows - 1) / rows))


def check_moe_expert_parallel_dense_default():
  """`check_moe_expert_parallel` with the buffered exchange at its default
  `EXCHANGE_SLACK` (None): whole buffers, no `cond`, on every mesh."""
  _buffered_exchange((None,))


def _buffered_exchange(slacks):
  from nvfp4_jax.training import moe  # pylint: disable=g-import-not-at-top
  default = moe.EXCHANGE_SLACK
  assert default is None, default
  moe.EXCHANGE = "buffered"
  try:
    for slack in slacks:
      moe.EXCHANGE_SLACK = slack
      print(f"slack {slack}")
      check_moe_expert_parallel(expert_only=slack is not None,
                                explicit=False)
  finally:
    moe.EXCHANGE, moe.EXCHANGE_SLACK = "auto", default
