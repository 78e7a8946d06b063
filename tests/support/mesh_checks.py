"""Mesh checks on 8 host CPU devices: `python tests/support/mesh_checks.py NAME...`.

`tests/sharding/test_mesh.py` runs each check in a fresh process: the device count is
fixed by `XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax is
imported, and a pytest worker has imported jax already. Each check raises
AssertionError (exit status 1) on a failure and prints what it measured.

Tolerances. A sharded GEMM sums some FP32 products across shards (Wgrad over
token shards; a row-parallel Fprop and a column-parallel Dgrad over `model`)
in another order than the single-device GEMM. Both compute
`alpha * sum_i a_i b_i` over n terms whose products `a_i b_i` are exact
(bf16 block values have at most 8 significant bits), so each result is within
`((n - 1) + 1) * u * alpha * sum_i |a_i b_i|` of the exact value (n - 1 FP32
additions in any order or grouping, one multiplication by alpha; u = 2^-24,
first order in u): the two differ by at most
`2 (n + 1) u * sum_i |a_i b_i|`, computed below element by element from the
dequantized operands (`gemm_bound`; +2 more terms absorb the FP32 rounding of
the dequantized values). Quantized operands (codes, scales, amax) must be
equal, bit for bit.
"""

from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
  raise RuntimeError("mesh_checks must set XLA_FLAGS before importing jax.")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# This folder (the tests' helpers), tests (`conftest`), tests/flax
# (`test_third_party`'s models) and the repository root.
_SUPPORT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _SUPPORT)
sys.path.insert(0, os.path.dirname(_SUPPORT))
sys.path.insert(0, os.path.join(os.path.dirname(_SUPPORT), "flax"))
sys.path.insert(0, os.path.dirname(os.path.dirname(_SUPPORT)))

import nvfp4_jax as nv  # noqa: E402
from nvfp4_jax import sharding as shd  # noqa: E402
from conftest import make_heavy_tailed  # noqa: E402

U = 2.0 ** -24
IMPLS = ("xla", "pallas")
DN = (((1,), (0,)), ((), ()))


def mesh(**sizes):
  return shd.make_mesh(**sizes)


def assert_same_q(a, b, what):
  """Codes, scale bytes and amax equal, bit for bit."""
  assert type(a) is type(b), (what, type(a), type(b))
  for field in ("codes", "scales", "amax"):
    u, v = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
    if u.dtype.itemsize == 1:
      u, v = u.view(np.uint8), v.view(np.uint8)
    assert u.shape == v.shape, (what, field, u.shape, v.shape)
    diff = int(np.sum(u != v)) if u.ndim else int(u.view(np.uint32) !=
                                                    v.view(np.uint32))
    assert diff == 0, f"{what}: {diff} {field} differ"


_DEQUANTIZE = jax.jit(lambda a, b: (nv.dequantize(a), nv.dequantize(b)))


def gemm_bound(a, b, n):
  """Bound on |sharded - single| of `a @ b.T` (see the module docstring)."""
  da, db = _DEQUANTIZE(a, b)
  da = np.abs(np.asarray(da, np.float64))
  db = np.abs(np.asarray(db, np.float64))
  return 2 * (n + 3) * U * (da @ db.T)


def check_within(got, want, bound, what):
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  worst = float(np.max(err - bound))
  print(f"  {what}: max |diff| {err.max():.3g}, max bound "
        f"{bound.max():.3g}, exact: {bool(np.all(err == 0))}")
  assert worst <= 0, f"{what}: exceeds the derived bound by {worst:.3g}"


# ----------------------------------------------------------------------------
# Quantization of a sharded tensor.
# ----------------------------------------------------------------------------


def check_quantize():
  m = mesh(data=2, fsdp=2, model=2)
  x = jnp.asarray(make_heavy_tailed((64, 64), seed=1))
  key = jax.random.key(3)
  split = P(("data", "fsdp"), "model")       # both dims split
  other = P("model", ("data", "fsdp"))       # the other way round
  for impl in IMPLS:
    t0 = time.perf_counter()
    for spec, block_2d, rounding in ((split, False, "nearest"),
                                     (split, True, "stochastic"),
                                     (other, False, "stochastic")):
      k = key if rounding == "stochastic" else None
      q = shd.quantize(x, m, spec, block_2d=block_2d, rounding=rounding,
                       key=k, implementation=impl)
      assert q.codes.sharding.spec == spec, q.codes.sharding
      assert_same_q(q, jax.jit(functools.partial(
          nv.quantize, block_2d=block_2d, rounding=rounding,
          implementation="xla"))(x, key=k),
                    f"quantize {impl} {spec} 2d={block_2d} {rounding}")
    q = shd.quantize_rht_t(x, m, split, rounding="stochastic", key=key,
                           implementation=impl)
    assert_same_q(q, jax.jit(functools.partial(
        nv.quantize_rht_t, rounding="stochastic", implementation="xla"))(
            x, key=key),
                  f"quantize_rht_t {impl}")
    row = nv.Operand(format="nvfp4", rounding="stochastic")
    wgrad = nv.Operand(format="nvfp4", rounding="stochastic", rht=True)
    k1, k2 = jax.random.split(key)
    got = shd.quantize_pair(x, m, split, row, wgrad, key_row=k1, key_t=k2,
                            implementation=impl)
    want = jax.jit(functools.partial(
        nv.quantize_pair, row=row, wgrad=wgrad, implementation="xla"))(
            x, key_row=k1, key_t=k2)
    assert_same_q(got[0], want[0], f"quantize_pair row {impl}")
    assert_same_q(got[1], want[1], f"quantize_pair rht_t {impl}")
    print(f"  sharded quantizers ({impl}) equal the whole tensor's: "
          f"{time.perf_counter() - t0:.1f}s")

  # MXFP4 with stochastic rounding: the same stream at the shard's offset.
  mx = nv.Operand(format="mxfp4", rounding="stochastic")
  got, _ = shd.quantize_pair(jnp.asarray(x), m, P(("data", "fsdp"), "model"),
                             mx, nv.Operand(format="bf16"), key_row=key)
  want = jax.jit(functools.partial(nv.quantize_mx, fmt="mxfp4",
                                   rounding="stochastic"))(x, key=key)
  for field in ("data", "scales"):
    np.testing.assert_array_equal(
        np.asarray(getattr(got, field)).view(np.uint8),
        np.asarray(getattr(want, field)).view(np.uint8))

  # The pure-XLA reference also partitions automatically (no shard_map):
  # XLA keeps the whole-tensor semantics, so the bytes are equal too.
  xs = jax.device_put(x, NamedSharding(m, split))
  auto = jax.jit(lambda x: nv.quantize(x, block_2d=True, rounding="stochastic",
                                       key=key, implementation="xla"))
  assert_same_q(auto(xs), auto(x), "auto-partitioned reference")
  ops = [c.op for c in shd.collectives(auto.lower(xs).compile())]
  print(f"  auto-partitioned reference: equal; collectives {ops}")


def check_errors():
  m = mesh(data=2, fsdp=2, model=2)
  x = jnp.ones((64, 64), jnp.float32)

  def raises(fn, *needles):
    try:
      fn()
    except ValueError as e:
      msg = str(e)
      for n in needles:
        assert n in msg, (n, msg)
      print(f"  {msg}")
      return
    raise AssertionError(f"no error for {needles}")

  # 64 columns over 8 devices: 8-element shards split the 16-element blocks.
  raises(lambda: shd.quantize(x, m, P(None, ("data", "fsdp", "model"))),
         "cols dimension (64)", "('data', 'fsdp', 'model')", "straddle")
  # 16x16 tiles: 64 rows over 8 devices.
  raises(lambda: shd.quantize(x, m, P(("data", "fsdp", "model"), None),
                              block_2d=True),
         "rows dimension (64)", "straddle")
  # The Wgrad operand's 16-token blocks: 64 tokens over 8 shards.
  raises(lambda: shd.quantize_rht_t(x, m, P(("data", "fsdp", "model"))),
         "tokens dimension (64)", "not a multiple of 16")
  # A layer: tensor parallelism that splits 16x16 weight tiles.
  w = jnp.ones((48, 64), jnp.float32)
  sh = shd.LinearSharding(mesh=m, tokens=("data", "fsdp"), fsdp="fsdp",
                          tensor="row", model="model")
  raises(lambda: nv.dot_general(jnp.ones((64, 48)), w, DN,
                                recipe=nv.Recipe.nvfp4(), key=jax.random.key(0),
                                sharding=sh, name="mlp/down"),
         "layer 'mlp/down'", "in (K) dimension (48)", "mesh axis 'model'")
  # Tokens of a layer: 32 tokens over data x fsdp = 4 shards of 8.
  raises(lambda: nv.dot_general(jnp.ones((32, 64)), jnp.ones((64, 64)), DN,
                                recipe=nv.Recipe.nvfp4(), key=jax.random.key(0),
                                sharding=sh),
         "tokens dimension (32)", "('data', 'fsdp')")
  raises(lambda: shd.make_mesh(data=3), "has 3 devices")


# ----------------------------------------------------------------------------
# dot_general: forward and gradients on every kind of split.
# ----------------------------------------------------------------------------


def _linear_shardings(m):
  base = dict(mesh=m, tokens=("data", "fsdp"))
  return {
      "data": shd.LinearSharding(**base),
      "fsdp": shd.LinearSharding(**base, fsdp="fsdp"),
      "column+fsdp": shd.LinearSharding(**base, fsdp="fsdp", tensor="column",
                                        model="model"),
      "row+fsdp": shd.LinearSharding(**base, fsdp="fsdp", tensor="row",
                                     model="model"),
  }


@functools.partial(jax.jit, static_argnums=0)
def _operands(recipe, x, w, dy, key):
  """The single-device layer's quantized operands (for the bounds)."""
  keys = recipe.operand_keys(key)
  qx, qxt = nv.quantize_pair(x, recipe.fprop_x, recipe.wgrad_x,
                             key_row=keys["fprop_x"], key_t=keys["wgrad_x"])
  qdy, qdyt = nv.quantize_pair(dy, recipe.dgrad_dy, recipe.wgrad_dy,
                               key_row=keys["dgrad_dy"],
                               key_t=keys["wgrad_dy"])
  qw = nv.quantize(w.T, block_2d=True)
  return qx, qxt, qdy, qdyt, qw


def _check_collectives(compiled, sh, k, n):
  """Only quantized weights are all-gathered (uint8 codes and scale bytes,
  ~4 bits per element): no activation, and no high-precision weight."""
  cs = [c for c in shd.collectives(compiled) if not c.trivial]
  gathers = [c for c in cs if c.op == "all-gather"]
  assert all(set(c.dtypes) == {"u8"} for c in gathers), [
      c.line for c in gathers]
  assert not [c for c in cs if c.op == "all-to-all"], cs
  moved = sum(c.result_bytes for c in gathers)
  weight = k * n // (sh.sizes[sh.model] if sh.tensor else 1)  # per device
  if sh.fsdp:
    # Codes (4 bits per element) and one scale byte per 16x16 tile.
    assert moved == weight // 2 + weight // 256, (moved, weight)
    print(f"  FSDP all-gather of the weight: {moved} B (u8 codes + u8 tile "
          f"scales) vs {2 * weight} B in bf16 ({2 * weight / moved:.2f}x "
          f"fewer), {4 * weight} B in FP32 ({4 * weight / moved:.2f}x)")
  else:
    assert not gathers, [c.line for c in gathers]
  summary = {}
  for c in cs:
    name = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
    summary[name] = summary.get(name, 0) + c.result_bytes
  print(f"  collectives (bytes per device): {summary}")


# The single-device layer's results and bounds on `check_dot_general`'s
# operands, by residuals: computed once per process.
_WHOLE = {}


def _layer_fn(recipe, key, sharding):
  """`(x, w, dy) -> (y, dx, dw)` of the NVFP4 layer on `sharding` (None:
  unsharded)."""
  def f(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.dot_general(
        x, w, DN, recipe=recipe, key=key, sharding=sharding), x, w)
    return (y, *vjp(dy))
  return f


def _placed(m, sharding, x, w, dy):
  """`x, w, dy` on mesh `m` as `sharding` lays them out (None: replicated)."""
  specs = ((P(), P(), P()) if sharding is None else
           (sharding.x_spec, sharding.kernel_spec, sharding.y_spec))
  return [jax.device_put(a, NamedSharding(m, s))
          for a, s in zip((x, w, dy), specs)]


def _layer_case():
  """The sharded-layer checks' mesh, sizes, operands and key."""
  m = mesh(data=2, fsdp=2, model=2)
  t, k, n = 128, 64, 96
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1))
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3))
  return m, (t, k, n), (x, w, dy), jax.random.key(7)


def check_dot_general(impl, names, residuals="codes"):
  m, (t, k, n), (x, w, dy), key = _layer_case()
  recipe = nv.Recipe.nvfp4(residuals=residuals)

  def compiled(sharding):
    args = _placed(m, sharding, x, w, dy)
    with nv.default_implementation(impl):
      c = jax.jit(_layer_fn(recipe, key, sharding)).lower(*args).compile()
    return c, c(*args)

  _, (y0, dx0, dw0) = compiled(None)
  qx, qxt, qdy, qdyt, qw = _operands(recipe, x, w, dy, key)
  bounds = {"y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n),
            "dw": gemm_bound(qxt, qdyt, t)}
  if impl == "xla" and residuals == "codes":  # For `check_user_mesh`.
    _WHOLE["codes"] = (y0, dx0, dw0, bounds)
  shardings = _linear_shardings(m)
  for name in names:
    sh = shardings[name]
    t0 = time.perf_counter()
    c, (y, dx, dw) = compiled(sh)
    print(f" {impl} {name} ({time.perf_counter() - t0:.1f}s)")
    assert dw.sharding.is_equivalent_to(
        NamedSharding(m, sh.kernel_spec), 2), dw.sharding
    for what, got, want in (("y", y, y0), ("dx", dx, dx0), ("dw", dw, dw0)):
      check_within(got, want, bounds[what], what)
    _check_collectives(c, sh, k, n)


def check_partial_sums():
  """`LinearSharding(partial_sums="output")` on bf16 operands: tensor
  parallelism's all-reduces (Y of the row-parallel layer, dX of the
  column-parallel one) carry bf16, half the bytes (the "float32" default
  carries FP32), and the results stay within the derived bound of the
  unsharded layer's. The bound: each shard's FP32 partial is rounded to
  bf16 (at most `2^-8` of its magnitude), their sum is rounded again, and
  the unsharded result once: `4 * 2^-8 * (|A| @ |B|)` plus the FP32
  reordering bound (`gemm_bound`), `|A|` and `|B|` the GEMM's dequantized
  operands."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  m = mesh(data=2, fsdp=2, model=2)
  t, k, n = 128, 64, 96
  bf16 = jnp.bfloat16
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1)).astype(bf16)
  w = (jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01).astype(bf16)
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3)).astype(bf16)
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()

  def compiled(sharding):
    f = _layer_fn(recipe, key, sharding)
    args = _placed(m, sharding, x, w, dy)
    # The sums over `model` as the program asks for them (XLA:CPU then
    # promotes a bf16 all-reduce to FP32; NCCL sums bf16).
    sums = re.findall(r"(\w+)\[\d+,\d+\] = psum\[axes=\('model',\)",
                      str(jax.make_jaxpr(f)(*args)))
    return sums, jax.jit(f)(*args)

  _, (y0, dx0, _) = compiled(None)
  qx, _, qdy, _, qw = _operands(recipe, x, w, dy, key)
  sizes = {"y": (qx, qw, k), "dx": (qdy, qw.T, n)}
  shardings = _linear_shardings(m)
  for name, what in (("row+fsdp", "y"), ("column+fsdp", "dx")):
    a, b, depth = sizes[what]
    da, db = _DEQUANTIZE(a, b)
    magnitude = (np.abs(np.asarray(da, np.float64))
                 @ np.abs(np.asarray(db, np.float64)).T)
    for sums, dtype in (("float32", "f32"), ("output", "bf16")):
      sh = dataclasses.replace(shardings[name], partial_sums=sums)
      reduces, (y, dx, _) = compiled(sh)
      assert reduces == [dtype], (name, sums, reduces)
      got, want = (y, y0) if what == "y" else (dx, dx0)
      bound = (4 * 2.0**-8 * magnitude if sums == "output" else 2.0**-7
               * np.abs(np.asarray(want, np.float64))) + gemm_bound(a, b,
                                                                    depth)
      check_within(got, want, bound, f"partial sums {sums} {name} {what}")
    print(f"  partial sums on {name}: all-reduces f32, then bf16")


def check_local_amax():
  """`LinearSharding(amax="local")`: each token shard quantizes X and dY
  with its own tensor amax. The forward pass (round to nearest, the
  weight's global 16x16 quantization) then equals the one-device layer run
  on each shard's tokens alone, bit for bit; no amax collective runs over
  the token axes (the default reduces X's and dY's amaxes over them), and
  on a row-parallel layer X's amax still reduces over `model` (X is split
  by features there)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  m = mesh(data=2, fsdp=2, model=2)
  t, k, n = 128, 64, 96
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1))
  # Each token shard's magnitudes differ: a shared amax would show.
  x = x * jnp.repeat(jnp.asarray([1.0, 8.0, 0.25, 3.0]), t // 4)[:, None]
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3))
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()

  def run(sharding):
    f, args = _layer_fn(recipe, key, sharding), _placed(m, sharding, x, w, dy)
    jaxpr = str(jax.make_jaxpr(f)(*args))
    reduced = re.findall(r"pmax\[axes=\(([^)]*)\)", jaxpr)
    return reduced, jax.jit(f)(*args)

  part = lambda a, i: a[i * 32:(i + 1) * 32]
  shards = [jax.jit(_layer_fn(recipe, key, None))(part(x, i), w, part(dy, i))
            for i in range(4)]
  want = np.concatenate([np.asarray(s[0]) for s in shards])
  # The row-parallel layer sums partial products across `model`: FP32
  # reordering within `gemm_bound` of each shard's own operands.
  bound = np.concatenate([gemm_bound(o[0], o[4], k) for o in (
      _operands(recipe, part(x, i), w, part(dy, i), key) for i in range(4))])
  shardings = _linear_shardings(m)
  for name in ("data", "row+fsdp"):
    glob, _ = run(shardings[name])
    local, (y, _, _) = run(dataclasses.replace(shardings[name], amax="local"))
    assert any("data" in a for a in glob), (name, glob)
    assert not any("'data'" in a for a in local), (name, local)
    if name == "row+fsdp":
      assert any("model" in a for a in local), local
    if name == "data":
      assert np.array_equal(np.asarray(y), want), f"local amax {name} y"
    else:
      check_within(y, want, bound, f"local amax {name} y")
    print(f"  local amax on {name}: the per-shard layer's y; amax "
          f"reductions {len(glob)} -> {len(local)}")


def check_wgrad_schedule():
  """`LinearSharding(wgrad_schedule=...)` under FSDP: "layer" (the
  default) ties each layer's weight gradient to its input gradient with an
  optimization barrier, for NVFP4 (inside the custom VJP's `shard_map`:
  each device's dX with its reduce-scattered dW shard, before dW's
  all-reduce over `data`, which stays free to overlap the layers below)
  and for a GEMM the recipe keeps in BF16 (XLA's own VJP of the plain
  product: the whole dX and dW); "xla" leaves both to XLA's scheduler. The
  barrier changes only the order: y, dX and dW are bit for bit those of
  "xla". Without `fsdp` there is no barrier."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  m, (t, k, n), (x, w, dy), key = _layer_case()
  shardings = _linear_shardings(m)

  def barriers(f, args):
    """The optimization barriers of `f`'s jaxpr, as `(shapes)` of their
    outputs, and the variables psum'd over `data`, by the barrier output
    they are (None: not one)."""
    out, names, summed = [], {}, []
    for line in str(jax.make_jaxpr(f)(*args)).splitlines():
      lhs = line.split("=")[0]
      if "optimization_barrier" in line:
        shapes = tuple(re.findall(r"\[([\d,]+)\]", lhs))
        out.append(shapes)
        for var, shape in zip(re.findall(r"(\w+):", lhs), shapes):
          names[var] = shape
      elif "psum[axes=('data',)" in line:
        summed += [names.get(v) for v in line.split("]")[-1].split()]
    return out, summed

  def local(a, spec):
    return ",".join(map(str, NamedSharding(m, spec).shard_shape(a.shape)))

  for rname, recipe in (("nvfp4", nv.Recipe.nvfp4()),
                        ("bf16", nv.Recipe.bf16())):
    for name in ("fsdp", "row+fsdp", "data"):
      got = {}
      for schedule in ("layer", "xla"):
        sh = dataclasses.replace(shardings[name], wgrad_schedule=schedule)
        f, args = _layer_fn(recipe, key, sh), _placed(m, sh, x, w, dy)
        got[schedule] = (barriers(f, args), jax.jit(f)(*args))
      # dX and dW pass one barrier together (the quantizers have barriers
      # of their own): NVFP4's per device, dW reduce-scattered over
      # `fsdp` (its stored shard, before the sum over `data`); BF16's
      # whole.
      sh = shardings[name]
      pair = ((local(x, sh.x_spec), local(w, sh.kernel_spec))
              if rname == "nvfp4" else (f"{t},{k}", f"{k},{n}"))
      (found, summed), _ = got["layer"]
      tied = found.count(pair)
      assert tied == (name != "data"), (rname, name, pair, found)
      assert pair not in got["xla"][0][0], (rname, name, got["xla"][0])
      if rname == "nvfp4" and tied:
        # dW's all-reduce over `data` takes the barrier's output.
        assert pair[1] in summed, (name, summed)
      for what, a, b in zip(("y", "dx", "dw"), got["layer"][1],
                            got["xla"][1]):
        assert np.array_equal(np.asarray(a), np.asarray(b)), (rname, name,
                                                              what)
      print(f"  {rname} {name}: dX and dW tied {tied}x with \"layer\", not "
            f"with \"xla\"; y, dX, dW equal")
  # `make_mesh(data=8)` carries an `fsdp` axis of size 1: no FSDP there,
  # so no barrier (it would keep each data-parallel all-reduce from
  # overlapping more than its own layer's work).
  plain = shd.LinearSharding(mesh=mesh(data=8), tokens=("data", "fsdp"),
                             fsdp="fsdp")
  for recipe in (nv.Recipe.nvfp4(), nv.Recipe.bf16()):
    f, args = _layer_fn(recipe, key, plain), _placed(plain.mesh, plain, x, w,
                                                     dy)
    found, _ = barriers(f, args)
    # Neither BF16's whole pair nor NVFP4's per-device one (8 token shards).
    for pair in ((f"{t},{k}", f"{k},{n}"), (f"{t // 8},{k}", f"{k},{n}")):
      assert pair not in found, (recipe.tag, found)
  print("  fsdp of size 1: not tied")


def check_sequence_parallel():
  """`LinearSharding(sequence=True)` (sequence parallelism over `model`) on
  the column- and row-parallel layers with FSDP: Y, dX and dW equal the
  same layer without it bit for bit, on heavy-tailed operands with the
  paper's recipe (stochastic rounding of dY, RHT on the Wgrad operands):
  quantizing a token shard with the tensor's amax at its own place gives
  the whole tensor's codes, and a two-shard reduce-scatter adds what the
  all-reduce adds. (The layer without it is checked against one device
  within the derived bound: `check_dot_general`.) Compiled, the
  activations' all-reduces over `model` become reduce-scatters of the same
  bytes, and the gathered activations are quantized bytes (uint8)."""
  import collections  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top
  m, (t, k, n), (x, w, dy), key = _layer_case()
  recipe = nv.Recipe.nvfp4()
  qx, _, qdy, _, qw = _operands(recipe, x, w, dy, key)
  bounds = {"y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n)}

  def run(sh):
    args = _placed(m, sh, x, w, dy)
    c = jax.jit(_layer_fn(recipe, key, sh)).lower(*args).compile()
    cs = [cl for cl in shd.collectives(c) if not cl.trivial]
    # Collectives over `model` (groups of 2 in this 2x2x2 mesh) moving
    # activations (more than the amaxes' few bytes).
    big = sorted(f"{cl.op} {'/'.join(sorted(set(cl.dtypes)))}" for cl in cs
                 if cl.result_bytes > 64)
    return big, c(*args)

  for name in ("column+fsdp", "row+fsdp"):
    sh = _linear_shardings(m)[name]
    seq = dataclasses.replace(sh, sequence=True)
    assert seq.x_spec != sh.x_spec or seq.y_spec != sh.y_spec
    before, want = run(sh)
    after, got = run(seq)
    for what, a, b in zip(("y", "dx", "dw"), got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=f"{name} {what}")
    # One all-reduce over `model` (Y's or dX's) became a reduce-scatter;
    # X or dY (codes and scale bytes of both operands) is gathered as bytes.
    nb, na = collections.Counter(before), collections.Counter(after)
    assert (na["all-reduce f32"], na["reduce-scatter f32"]) == (
        nb["all-reduce f32"] - 1, nb["reduce-scatter f32"] + 1), (before, after)
    assert na["all-gather u8"] == nb["all-gather u8"] + 4, (before, after)
    assert sum(na.values()) == sum(nb.values()) + 4, (before, after)
    print(f"  sequence parallel {name}: y, dx, dw equal; {before} -> {after}")
    # The collective matmul: dW bit for bit (its GEMM is not chunked); Y
    # and dX from GEMMs of a chunk's rows, whose K sums may run in another
    # order than the whole GEMM's: within `gemm_bound`. The activations'
    # gather and reduce-scatter over `model` become
    # collective-permutes: of X's or dY's Fprop or Dgrad operand (codes and
    # scale bytes; the Wgrad operand is still all-gathered, off the critical
    # path) and of the partial sums.
    ring, got = run(dataclasses.replace(seq, collective_matmul=True))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    check_within(got[0], want[0], bounds["y"], f"{name} ring y")
    check_within(got[1], want[1], bounds["dx"], f"{name} ring dx")
    nr = collections.Counter(ring)
    assert nr["reduce-scatter f32"] == nb["reduce-scatter f32"], ring
    assert nr["all-gather u8"] < na["all-gather u8"], ring
    assert nr["collective-permute u8"] >= 1, ring
    assert nr["collective-permute f32"] == 1, ring
    print(f"  collective matmul {name}: dw equal, y and dx within the "
          f"bound; {ring}")


def check_collective_matmul_four():
  """The collective matmul's rings over a `model` axis of four devices
  (`data=2, model=4`), against sequence parallelism's plain gathers and
  reduce-scatters: the weight gradients bit for bit, Y and dX (GEMMs of
  chunks, and ring sums of four partials) within the FP32 reordering bound
  (`gemm_bound` of the whole product covers any order of its terms)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  m = mesh(data=2, model=4)
  t, k, n = 128, 64, 128
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1))
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3))
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()
  qx, _, qdy, _, qw = _operands(recipe, x, w, dy, key)
  for style in ("column", "row"):
    seq = shd.LinearSharding(mesh=m, tokens=("data",), tensor=style,
                             model="model", sequence=True)
    outs = []
    for sh in (seq, dataclasses.replace(seq, collective_matmul=True)):
      args = _placed(m, sh, x, w, dy)
      outs.append(jax.jit(_layer_fn(recipe, key, sh))(*args))
    (y0, dx0, dw0), (y, dx, dw) = outs
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw0))
    check_within(y, y0, gemm_bound(qx, qw, k), f"{style} ring y")
    check_within(dx, dx0, gemm_bound(qdy, qw.T, n), f"{style} ring dx")
    print(f"  collective matmul {style} on model=4: as sequence parallelism")


def check_wgrad_sums():
  """`LinearSharding(wgrad_sums="bfloat16")`: the weight gradient's sums
  over the token shards (the reduce-scatter over `fsdp`, the all-reduce
  over `data`) carry bf16, half the bytes ("float32", the default, carries
  FP32), and dW stays within the derived bound of the unsharded layer's.
  The bound: S = 4 token shards; each shard's FP32 Wgrad result is rounded
  to bf16 once (`u = 2^-8` of its magnitude) and the S - 1 additions
  between them round again, each within `u` of the running sum: S roundings
  of at most `u * (|A| @ |B|)` (to first order; `(1 + u)^S` covers the
  rest), `|A|`, `|B|` the Wgrad GEMM's dequantized operands, plus the FP32
  reordering bound (`gemm_bound`). y and dX do not change."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  m, (t, k, n), (x, w, dy), key = _layer_case()
  recipe = nv.Recipe.nvfp4()

  def run(sharding):
    f, args = _layer_fn(recipe, key, sharding), _placed(m, sharding, x, w, dy)
    # The weight gradient's sums as the program asks for them (XLA:CPU
    # promotes a bf16 all-reduce to FP32; NCCL sums bf16).
    sums = re.findall(r"(\w+)\[[\d,]+\] = (psum|reduce_scatter)\[",
                      str(jax.make_jaxpr(f)(*args)))
    return sorted(set(sums)), jax.jit(f)(*args)

  _, (y0, dx0, dw0) = run(None)
  _, qxt, _, qdyt, _ = _operands(recipe, x, w, dy, key)
  da, db = _DEQUANTIZE(qxt, qdyt)
  magnitude = (np.abs(np.asarray(da, np.float64))
               @ np.abs(np.asarray(db, np.float64)).T)
  shards, u = 4, 2.0**-8
  bound = (shards * u * (1 + u)**shards * magnitude
           + gemm_bound(qxt, qdyt, t))
  shardings = _linear_shardings(m)
  # The row-parallel layer with FSDP has every sum: dW's reduce-scatter
  # over `fsdp` and all-reduce over `data`, and Y's all-reduce over `model`.
  for name, kinds in (("row+fsdp", {"psum", "reduce_scatter"}),):
    got = {}
    for sums in ("float32", "bfloat16"):
      sh = dataclasses.replace(shardings[name], wgrad_sums=sums)
      got[sums] = run(sh)
    dtype = {"float32": "f32", "bfloat16": "bf16"}
    for sums, (reduces, (y, dx, dw)) in got.items():
      # Y's sum over `model` stays FP32 (`partial_sums`'s default).
      wanted = {(dtype[sums], kind) for kind in kinds}
      assert wanted <= set(reduces), (name, sums, reduces)
      if sums == "bfloat16":
        assert ("f32", "reduce_scatter") not in reduces, (name, reduces)
      check_within(dw, dw0, bound if sums == "bfloat16" else
                   gemm_bound(qxt, qdyt, t), f"wgrad sums {sums} {name} dw")
    for what, a, b in zip(("y", "dx"), got["float32"][1], got["bfloat16"][1]):
      assert np.array_equal(np.asarray(a), np.asarray(b)), (name, what)
    print(f"  wgrad sums on {name}: {sorted(kinds)} f32, then bf16")
  # Through the trainer (`TrainConfig.wgrad_sums`, `--wgrad-sums`): the GPT
  # step's quantized layers reduce-scatter their gradients in that dtype.
  for sums, dtype in (("float32", "f32"), ("bfloat16", "bf16")):
    tr = _trainer(GPT_MESHES["fsdp"], train=dict(wgrad_sums=sums))
    st = jax.eval_shape(tr.fns.init_state)
    batch = jax.ShapeDtypeStruct((1, tr.cfg.micro_batch,
                                  tr.cfg.seq_len + 1), jnp.int32)
    jaxpr = str(jax.make_jaxpr(tr.fns.loss_and_grads)(
        st.params, batch, jax.ShapeDtypeStruct((), jnp.int32)))
    found = set(re.findall(r"(\w+)\[[\d,]+\] = reduce_scatter\[", jaxpr))
    assert found == {dtype}, (sums, found)
  print("  trainer: --wgrad-sums reaches the GPT's layers")


def check_dot_general_xla():
  check_dot_general("xla", ("data", "fsdp", "column+fsdp", "row+fsdp"))


def check_dot_general_pallas():
  check_dot_general("pallas", ("column+fsdp", "row+fsdp"))


def check_dot_general_values():
  """Residuals saved as block values (`Recipe(residuals="values")`): the
  same results on every layout, and the FSDP weight still travels as codes
  (values apply to shards' own residuals, never to what is gathered)."""
  check_dot_general("xla", ("column+fsdp", "row+fsdp"), "values")


# ----------------------------------------------------------------------------
# dot_general under the user's own mesh: sharding in types and auto mode.
# ----------------------------------------------------------------------------

# (x spec [batch, seq, in], kernel spec [in, out], the LinearSharding the
# operands' types give) on a mesh with the user's axis names ("batch",
# "fsdp", "tensor"): 2 x 2 x 2. Two layouts need resharding (RESHARDED): the
# weight split over an axis that does not split the batch (gathered in
# FP32, as XLA would), and the sequence split while the batch is not (the
# tokens' merge moves X).
USER_LAYOUTS = {
    "data": (P(("batch", "fsdp")), P(), dict(tokens=("batch", "fsdp"))),
    "fsdp": (P(("batch", "fsdp")), P("fsdp", None),
             dict(tokens=("batch", "fsdp"), fsdp="fsdp")),
    # MaxText's `embed` axis on the kernel's out dimension (a down proj).
    "fsdp_out": (P(("batch", "fsdp")), P(None, "fsdp"),
                 dict(tokens=("batch", "fsdp"), fsdp="fsdp", fsdp_dim=1)),
    "weight_only": (P("batch"), P("fsdp", "tensor"),
               dict(tokens=("batch",), tensor="column", model="tensor")),
    "column+fsdp": (P(("batch", "fsdp")), P("fsdp", "tensor"),
                    dict(tokens=("batch", "fsdp"), fsdp="fsdp",
                         tensor="column", model="tensor")),
    "row+fsdp": (P(("batch", "fsdp"), None, "tensor"), P("tensor", "fsdp"),
                 dict(tokens=("batch", "fsdp"), fsdp="fsdp", tensor="row",
                      model="tensor")),
    # The sequence split, the batch not: the tokens' merge reshards X.
    "sequence": (P(None, ("batch", "fsdp")), P(),
                 dict(tokens=("batch", "fsdp"))),
}
RESHARDED = ("weight_only", "sequence")


def check_user_mesh(names=tuple(USER_LAYOUTS) + ("rules",),
                    modes=("explicit", "auto")):
  """`nv.dot_general` on `[batch, seq, in] x [in, out]` operands sharded
  the user's way on a mesh the library did not make, forward and both
  gradients: under `jax.set_mesh` with Explicit axes (the op reads the
  operands' sharding types, runs per shard and returns sharded types), and
  in auto mode (`jax.jit` in/out shardings: XLA partitions the reference).
  Each equals the single-device op within `gemm_bound` (the same quantized
  operands, FP32 sums in another order); under Explicit axes, where the
  layout needs no reshard, only quantized weight bytes are gathered."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  # `check_dot_general`'s operands, split into 4 sequences of 32 tokens.
  b, s, k, n = 4, 32, 64, 96
  t = b * s
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1)).reshape(b, s, k)
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3)).reshape(b, s, n)
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()
  dn = (((2,), (0,)), ((), ()))

  def f(x, w, dy, rules=None):
    def op(x, w):
      if rules is None:
        return nv.dot_general(x, w, dn, recipe=recipe, key=key)
      with nv.mesh_rules(rules):
        return nv.dot_general(x, w, dn, recipe=recipe, key=key, name="mlp")
    y, vjp = jax.vjp(op, x, w)
    return (y, *vjp(dy))
  if "codes" not in _WHOLE:
    def whole(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: nv.dot_general(x, w, DN, recipe=recipe,
                                                   key=key), x, w)
      return (y, *vjp(dy))
    y0, dx0, dw0 = jax.jit(whole)(x.reshape(t, k), w, dy.reshape(t, n))
    qx, qxt, qdy, qdyt, qw = _operands(recipe, x.reshape(t, k), w,
                                       dy.reshape(t, n), key)
    _WHOLE["codes"] = (y0, dx0, dw0, {
        "y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n),
        "dw": gemm_bound(qxt, qdyt, t)})
  y0, dx0, dw0, bounds = _WHOLE["codes"]
  y0, dx0 = y0.reshape(b, s, n), dx0.reshape(b, s, k)
  bounds = dict(bounds, y=bounds["y"].reshape(b, s, n),
                dx=bounds["dx"].reshape(b, s, k))
  axes = ("batch", "fsdp", "tensor")
  for mode in modes:
    types = (AxisType.Explicit if mode == "explicit" else AxisType.Auto,) * 3
    m = jax.make_mesh((2, 2, 2), axes, axis_types=types)
    # "rules": the library's MeshRules on the user's axis names (the
    # layout of "row+fsdp"): per shard in auto mode too, Pallas included.
    rules = nv.MeshRules(mesh=m, batch=("batch", "fsdp"), fsdp="fsdp",
                         model="tensor", tensor_parallel=((r"mlp", "row"),))
    for name in names:
      xs, ws, want = USER_LAYOUTS["row+fsdp" if name == "rules" else name]
      fn_rules = rules if name == "rules" else None
      xs = P(*(tuple(xs) + (None,) * (3 - len(xs))))
      ys = P(xs[0], xs[1], "tensor" if want.get("tensor") == "column" else
             None)
      t0 = time.perf_counter()
      with jax.set_mesh(m):
        args = [jax.device_put(a, NamedSharding(m, sp))
                for a, sp in ((x, xs), (w, ws), (dy, ys))]
        fr = functools.partial(f, rules=fn_rules)
        if mode == "explicit":
          compiled = jax.jit(fr).lower(*args).compile()
        else:
          fn = jax.jit(fr, in_shardings=tuple(
              NamedSharding(m, sp) for sp in (xs, ws, ys)),
                       out_shardings=tuple(NamedSharding(m, sp)
                                           for sp in (ys, xs, ws)))
          compiled = fn.lower(*args).compile()
        y, dx, dw = compiled(*args)
      print(f" {mode} {name} ({time.perf_counter() - t0:.1f}s): x {xs}, "
            f"kernel {ws}")
      if mode == "explicit":
        got = shd.linear_sharding_for(m, P(nv.core.spmd.entry(
            [a for e in xs[:2] for a in nv.core.spmd.entry_axes(e)]), xs[2]),
                                      ws)
        assert got == shd.LinearSharding(mesh=m, **want), (name, got)
        # The op returns sharded types: the gradients keep the operands'.
        assert dw.sharding.is_equivalent_to(NamedSharding(m, ws), 2), (
            name, dw.sharding)
        assert dx.sharding.is_equivalent_to(NamedSharding(m, xs), 3), (
            name, dx.sharding)
        assert y.sharding.is_equivalent_to(NamedSharding(m, ys), 3), (
            name, y.sharding)
      for what, g, ref in (("y", y, y0), ("dx", dx, dx0), ("dw", dw, dw0)):
        check_within(g, ref, bounds[what], what)
      cs = [c for c in shd.collectives(compiled) if not c.trivial]
      gathers = [c for c in cs if c.op == "all-gather"]
      if (mode == "explicit" and name not in RESHARDED) or name == "rules":
        assert all(set(c.dtypes) == {"u8"} for c in gathers), (
            name, [c.line for c in gathers])
      summary = {}
      for c in cs:
        op = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
        summary[op] = summary.get(op, 0) + c.result_bytes
      print(f"  collectives (bytes per device): {summary}")


def check_readme_explicit():
  """The docs' sharding-in-types example runs as written: the kernel's
  gradient keeps the kernel's FSDP sharding."""
  import pathlib  # pylint: disable=g-import-not-at-top
  readme = pathlib.Path(__file__).resolve().parents[2] / "docs" / "sharding.md"
  blocks = [b for b in re.findall(r"```python\n(.*?)```", readme.read_text(),
                                  re.S) if "AxisType.Explicit" in b]
  assert len(blocks) == 1, len(blocks)
  ns = {}
  exec(compile(blocks[0], "README.md", "exec"), ns)  # pylint: disable=exec-used
  kernel = ns["grads"]["params"]["kernel"]
  assert str(jax.typeof(kernel)) == "float32[64@fsdp,64]", jax.typeof(kernel)
  print(f"  README example: kernel gradient {jax.typeof(kernel)}")


def check_user_mesh_quick():
  """`check_user_mesh` under Explicit axes on FSDP with tensor parallelism
  (the default test tier)."""
  check_user_mesh(("row+fsdp",), ("explicit",))
  # 17 tokens per shard straddle the Wgrad operands' 16-token blocks: split
  # so by the operands' types, the layer runs on a split that cuts no block
  # (`LinearSharding.fitted`; tests/sharding/test_explicit_reshard.py checks the
  # numbers); a split the caller declares (`sharding=`, as `MeshRules`
  # do) is named, not silently gathered, as in auto mode.
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  m = jax.make_mesh((4, 2), ("batch", "fsdp"),
                    axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(m):
    x = jax.device_put(jnp.ones((8, 17, 64)), P(("batch", "fsdp")))
    w = jax.device_put(jnp.ones((64, 48)), P("fsdp"))

    def grad(sharding):
      return jax.eval_shape(jax.grad(lambda x, w: jnp.sum(nv.dot_general(
          x, w, (((2,), (0,)), ((), ())), recipe="nvfp4",
          key=jax.random.key(0), name="mlp/up", sharding=sharding))), x, w)
    assert jax.typeof(grad(None)).sharding.spec == jax.typeof(x).sharding.spec
    declared = shd.LinearSharding(mesh=m, tokens=("batch", "fsdp"),
                                  fsdp="fsdp")
    try:
      grad(declared)
    except ValueError as e:
      assert "layer 'mlp/up'" in str(e) and "shards of 17" in str(e), e
      print(f"  {e}")
    else:
      raise AssertionError("no error for a declared split of 17 tokens "
                           "per shard")


def _no_f32_gather_of(compiled, shapes, what):
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
  _no_f32_gather_of(compiled, [(128, 64)], "pair kernel")
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
  qx, qxt, qdy, qdyt, _ = _operands(recipe, x.reshape(t, k), w,
                                    dy.reshape(t, n), key)
  del qx, qdy
  check_within(dw, dw0, gemm_bound(qxt, qdyt, t), "dw")
  _no_f32_gather_of(compiled, [(t, k), (t, n)], "auto dot_general")
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
  _no_f32_gather_of(compiled, [(t, n)], "quantize_rht_t")
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
  _no_f32_gather_of(compiled, [x.shape, dy.shape], "auto ragged_dot")
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
    bit. The FP32 router runs on token shards in another shape (its
    logits move, as `check_moe_expert_parallel` derives): y and the
    router's gradient within those bounds. The layer's dispatch (a gather
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
  _no_f32_gather_of(compiled, [x.shape, dy.shape], "auto mxfp4 ragged_dot")
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
    _no_f32_gather_of(compiled, [x.shape], name)
    print(f"  grouped quantizer {name} on batch x fsdp: equal, codes "
          f"{got.data.sharding.spec}")


def _check_auto_moe_layer(m):
  """The `NVFP4MoE` part of `check_auto_moe`."""
  from nvfp4_jax.flax.moe import NVFP4MoE  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_quantize import pallas_triton as kernels  # pylint: disable=g-import-not-at-top
  d, t, num = 64, 128, 4
  x = jax.random.normal(jax.random.key(0), (8, t // 8, d))
  layer = NVFP4MoE(num_experts=num, hidden=32, top_k=2)
  params = layer.init(jax.random.key(1), x)["params"]

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
    try:
      # A function of its own: traced again, with the recording kernel.
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


# ----------------------------------------------------------------------------
# The vendored third-party models, sharded the user's way.
# ----------------------------------------------------------------------------


class _LayerRecorder:
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
        rec = _LayerRecorder()
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
            _check_step_collectives(f"{model} {layout}", compiled)
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
  qx, qxt, qdy, qdyt, qw = _operands(recipe, jnp.asarray(x2),
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


# ----------------------------------------------------------------------------
# A GPT train step on DP, FSDP, TP and a mixed mesh.
# ----------------------------------------------------------------------------

# Block 0 in NVFP4, block 1 with a BF16 forward (the late switch's "forward"
# mode): quantized and high-precision GEMMs both run sharded.
GPT = dict(d_model=64, num_layers=2, num_heads=2, d_ff=64)
GPT_RULES = ((r"block_1/", "bf16_forward"),)
GPT_MESHES = {"dp": dict(data=8), "fsdp": dict(data=2, fsdp=4),
              "tp": dict(data=4, model=2),
              "mixed": dict(data=2, fsdp=2, model=2)}


def _trainer(mesh_sizes, gpt_rules=GPT_RULES, train=None, **gpt):
  import train.loop as loop  # pylint: disable=g-import-not-at-top
  from models import preset  # pylint: disable=g-import-not-at-top
  from tiny_training import small_corpus  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  rules = nv.PrecisionRules(rules=tuple(
      (p, nv.Recipe.from_name(r)) for p, r in gpt_rules))
  cfg = TrainConfig(preset="tiny", precision="nvfp4", steps=8, batch_size=8,
                    seq_len=16, lr=3e-3, warmup_steps=1, eval_every=8,
                    ckpt_every=8, eval_batches=1, diagnostics=False,
                    **(train or {}))
  real = loop.make_rules
  loop.make_rules = lambda cfg, n: rules
  try:
    return loop.Trainer(cfg, small_corpus(), preset("tiny", **dict(GPT, **gpt)),
                        mesh=None if mesh_sizes is None else
                        mesh(**mesh_sizes))
  finally:
    loop.make_rules = real


def _capture(trainer):
  """A jitted `(params, batch, step) -> (loss, {layer: (input, output)},
  {layer: output cotangent})` on one device, with flax interceptors (a zero
  perturbation added to each output yields its cotangent)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from train.step import cross_entropy  # pylint: disable=g-import-not-at-top
  fns = trainer.fns
  kinds = (nv.NVFP4Dense, nn.Dense, nn.Embed, nn.RMSNorm)

  def run(perturb, params, mb, step):
    key = jax.random.fold_in(jax.random.fold_in(fns._sr_key, step), 0)  # pylint: disable=protected-access
    rec = {}

    def icpt(next_fun, args, kwargs, ctx):
      y = next_fun(*args, **kwargs)
      if ctx.method_name == "__call__" and isinstance(ctx.module, kinds):
        path = "/".join(ctx.module.scope.path)
        rec[path] = (args[0], y)
        if perturb is not None:
          y = y + perturb[path]
      return y
    with nn.intercept_methods(icpt):
      logits = fns.forward(params, mb[:, :-1], step, key)
    return cross_entropy(logits, mb[:, 1:]), rec

  @jax.jit
  def capture(params, batch, step):
    shapes = jax.eval_shape(lambda: run(None, params, batch[0], step)[1])
    zeros = {p: jnp.zeros(y.shape, y.dtype) for p, (_, y) in shapes.items()}
    (loss, rec), dys = jax.value_and_grad(run, has_aux=True)(
        zeros, params, batch[0], step)
    return loss, rec, dys
  return capture


def _term_sums(trainer, capture, params, batch, step):
  """`S = sum_t |tau_t|` for every gradient entry, where `tau_t` is token
  t's term of the sum over the batch's N tokens that the gradient is (for
  an NVFP4 Wgrad, an upper bound: its terms are products of quantized
  RHT'd operands, each at most 17/16 of its 16-token block's max, E4M3
  scale rounding included), from each layer's captured input, output and
  output cotangent (which holds the loss mean's 1/N)."""
  loss, rec, dys = capture(params, batch, step)
  sums, flips = {}, {}
  for path, (x, y) in rec.items():
    dy = np.abs(np.asarray(dys[path], np.float64).reshape(-1, y.shape[-1]))
    if path == "embed":
      table = np.zeros(_get(params, path)["embedding"].shape)
      np.add.at(table, np.asarray(x).reshape(-1), dy)
      sums[f"{path}/embedding"] = table
      continue
    xa = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    if path.endswith("norm"):
      scale = np.asarray(_get(params, path)["scale"], np.float64)
      ya = np.asarray(y, np.float64).reshape(-1, y.shape[-1])
      sums[f"{path}/scale"] = np.sum(np.abs(ya / scale) * dy, axis=0)
      flip = _dgrad_flip(trainer, params, rec, dys, path, ya / scale)
      if flip is not None:
        flips[f"{path}/scale"] = flip
      continue
    recipe = trainer.rules.recipe_at(path)
    if path.startswith("block") and recipe.gemm_format("wgrad") == "nvfp4":
      def block_max(z):  # [features, tokens] -> max over 16-token blocks
        z = np.abs(np.asarray(z, np.float64))
        f, t = z.shape
        return np.repeat(z.reshape(f, t // 16, 16).max(-1), 16, axis=1)
      a = block_max(nv.rht(jnp.asarray(xa.T, jnp.float32)))
      b = block_max(nv.rht(jnp.asarray(dy.T, jnp.float32)))
      sums[f"{path}/kernel"] = (17 / 16) ** 2 * (1 + 2.0 ** -10) * (a @ b.T)
      # One operand code that crossed a rounding boundary (see
      # `check_gpt_step`) moves one term by at most the gap between two
      # neighbouring E2M1 values, 2 scales <= (17/16) x its block's max / 3,
      # times its partner (<= 17/16 of the partner's block max).
      flips[f"{path}/kernel"] = ((17 / 16) ** 2 * (1 + 2.0 ** -10) / 3 *
                                 np.max(a[:, None, :] * b[None, :, :], -1))
    else:
      sums[f"{path}/kernel"] = np.abs(xa).T @ dy
  return float(loss), sums, flips


# The NVFP4 layer each norm's output feeds (`models.gpt.Block`).
_NORM_CONSUMERS = {"attn_norm": "attn/qkv", "mlp_norm": "mlp/up"}


def _dgrad_flip(trainer, params, rec, dys, path, xhat):
  """The most one flipped code of an NVFP4 Dgrad's output cotangent moves
  one term of the gradient of the norm scale whose output that layer reads
  (None where there is none, or its Dgrad is not NVFP4).

  The norm scale's gradient is `sum_t xhat[t, i] dX[t, i]` with `dX = dY_q
  W_q` the layer's Dgrad. A value of `dY` that the step reorders by its few
  ulp can land on the other side of its stochastic-rounding threshold (as
  in a Wgrad, `_term_sums`), which moves `dY_q[t, o]` by at most the gap
  between two neighbouring E2M1 values, 2 scales <= (17/16) x its 16-value
  block's max / 3 (E4M3 scale rounding included), and so token t's term by
  that times `|W_q[o, i]|` (<= (17/16)(1 + 2^-10) x the max of its 16x16
  tile of W) times `|xhat[t, i]|`: at most the max of that product over t
  and o. (Seen on the H200 host's CPU at `block_1/mlp_norm/scale`, none on
  this project's 2-core machines.)"""
  block, _, name = path.rpartition("/")
  consumer = f"{block}/{_NORM_CONSUMERS.get(name, '')}"
  if (consumer not in rec or trainer.rules.recipe_at(consumer).gemm_format(
      "dgrad") != "nvfp4"):
    return None
  dy = np.abs(np.asarray(dys[consumer], np.float64))
  dy = dy.reshape(-1, dy.shape[-1])
  t, out = dy.shape
  bmax = np.repeat(dy.reshape(t, out // 16, 16).max(-1), 16, axis=1)
  w = np.abs(np.asarray(_get(params, consumer)["kernel"], np.float64))
  k = w.shape[0]  # [in, out]
  tmax = np.repeat(np.repeat(w.reshape(k // 16, 16, out // 16, 16).max(
      (1, 3)), 16, axis=0), 16, axis=1)
  gap = (17 / 16) / 3 * bmax                              # [t, out]
  wq = (17 / 16) * (1 + 2.0**-10) * tmax                  # [in, out]
  move = np.abs(xhat)[:, :, None] * gap[:, None, :] * wq[None, :, :]
  return move.max(axis=(0, 2))


def _get(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def _flat(tree):
  return {"/".join(str(k.key) for k in kp): np.asarray(g, np.float64)
          for kp, g in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _within(what, loss, grads, ref, factor):
  """|loss - ref loss| and every |g - ref g| within `factor` x their
  per-token term sums, plus, in an NVFP4 Wgrad and in a norm scale an
  NVFP4 Dgrad reads, one flipped operand code per entry (counted); returns the worst ratio to the bound and the number
  of entries that needed the flip."""
  loss0, grads0, sums, flips = ref
  dl = abs(float(loss) - loss0)
  assert dl <= factor * loss0, (what, dl)  # S = N * loss, and loss is / N.
  worst, flipped = dl / (factor * loss0), 0
  for path, g in _flat(grads).items():
    err = np.abs(g - grads0[path])
    bound = factor * sums[path]  # The cotangents hold the mean's 1/N.
    over = err > bound
    if path in flips:
      flipped += int(np.sum(over))
      bound = bound + np.where(over, flips[path], 0)
    assert np.all(err <= bound), (what, path, float(np.max(err - bound)))
    worst = max(worst, float(np.max(
        np.where(over, 0, err) / np.maximum(factor * sums[path], 1e-45))))
  return dl, worst, flipped


def _check_step_collectives(name, compiled):
  """What the sharded step communicates. Inside the NVFP4 layers (their
  `nvfp4_layer[...]` name scopes in the HLO metadata) every all-gather
  moves quantized weight bytes (uint8), except the weight of a GEMM the
  recipe keeps in BF16: no activation is gathered, and no weight travels
  in high precision for a quantized GEMM; the other
  collectives there are amax maxima (uint32) and FP32 sums (row-parallel
  outputs, column-parallel input gradients, weight gradients), and with
  the collective matmul the rings' collective-permutes of quantized
  operands and FP32 partial sums. Outside
  them XLA partitions the high-precision parts itself: it gathers the
  head's weight, and the embedding's lookup and scatter over a
  vocabulary-split table move token ids and the (small) output gradient.
  Inside the GPT's attention and MLP, nothing is resharded with tensor
  parallelism either (`_block_reshards`, checked by `check_gpt_step`)."""
  cs = [c for c in shd.collectives(compiled) if not c.trivial]
  inside = [c for c in cs if "nvfp4_layer[" in c.line]
  for c in inside:
    tag = re.search(r"nvfp4_layer\[[^|]*\|([^\]]*)\]", c.line).group(1)
    if c.op == "all-gather":
      # Only a GEMM the recipe keeps in BF16 gathers its weight unquantized.
      assert set(c.dtypes) == {"u8"} or "=bf16" in tag, (name, c.line)
    elif c.op == "collective-permute":
      # The collective matmul's rings: quantized operands (u8) and FP32
      # partial sums (a GEMM kept in BF16: its own dtype).
      assert set(c.dtypes) <= {"u8", "f32"} or "=bf16" in tag, (name,
                                                                 c.line)
    else:
      assert c.op in ("all-reduce", "reduce-scatter"), (name, c.line)
      assert set(c.dtypes) <= {"u32", "f32"}, (name, c.line)
  summary = {"NVFP4 layers": {}, "elsewhere": {}}
  for c in cs:
    where = summary["NVFP4 layers" if c in inside else "elsewhere"]
    key = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
    where[key] = where.get(key, 0) + c.result_bytes
  for where, d in summary.items():
    print(f"    {where}, bytes per device: {d}")


def _block_reshards(compiled, params):
  """The collectives XLA adds inside a GPT block's attention or MLP
  (op names under `/attn/` or `/mlp/`) to reshard activations: every
  all-to-all and collective-permute there, and every all-gather outside
  the NVFP4 layers whose results are not whole parameters (a weight
  gathered over `fsdp` before use). Inside the layers every all-gather is
  a weight's (`_check_step_collectives`). With the fused `qkv`
  and `[gate, up]` columns laid out "interleaved" (`GPTConfig.fused_layout`)
  a contiguous split over `model` gives each device whole heads and
  matching gate and up columns: the list is empty. With the
  "concatenated" layout XLA reshards q, k, v to heads and the MLP's halves
  (all-to-all, collective-permute, gathers of the hidden activations)."""
  shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
  out = []
  for c in shd.collectives(compiled):
    name = re.search(r'op_name="([^"]*)"', c.line)
    name = name.group(1) if name else ""
    if c.trivial or not re.search(r"/(attn|mlp)/", name):
      continue
    if c.op == "collective-permute" and "nvfp4_layer[" in name:
      continue  # A collective matmul's ring (`_check_step_collectives`).
    if c.op in ("all-to-all", "collective-permute"):
      out.append(f"{c.op} {c.dtypes} {name}")
    elif (c.op == "all-gather" and "nvfp4_layer[" not in name
          and not all(s in shapes for _, s in c.results)):
      out.append(f"{c.op} {c.dtypes} {c.results} {name}")
  return out


def _check_weights_gathered(name, compiled, params):
  """XLA's own partition of a step's high-precision parts moves weights,
  not activations: every all-gather's results are whole parameters (the
  FSDP gather of a weight before use), and nothing is exchanged all-to-all.
  Left to itself XLA gathers the whole batch's output gradients (and token
  ids) to compute each FSDP shard's weight gradient, and reshards the
  norms' activations all-to-all (`training.dot_general._gathered_weight`,
  `MeshRules.gathered`)."""
  shapes = {tuple(np.shape(x)) for x in jax.tree.leaves(params)}
  cs = [c for c in shd.collectives(compiled) if not c.trivial]
  for c in cs:
    assert c.op != "all-to-all", (name, c.line)
    if c.op == "all-gather":
      assert all(s in shapes for _, s in c.results), (name, c.line)
  print(f"    {name}: {sum(c.op == 'all-gather' for c in cs)} all-gathers, "
        f"all of whole parameters; no all-to-all")


def check_gpt_step(names=("dp", "mixed"), resume=True, gpt_rules=GPT_RULES,
                   train=None):
  """One train step from the same state and batch on meshes `names` (here
  the data-parallel one and the mixed one, which splits along all three
  axes; `check_gpt_step_fsdp_tp` runs the pure FSDP and tensor-parallel
  ones), and a mesh checkpoint resumed on one device and on another mesh.

  Tolerance (first order in u = 2^-24). The sharded step reorders FP32 sums
  of two kinds: over the N tokens of the batch (every gradient, the loss
  mean) and over features inside each token's computation (a row-parallel
  GEMM, a column-parallel Dgrad, and XLA:CPU's reductions, which it compiles
  differently for fewer rows per device: RMSNorm's outputs move by 1-2 ulp).
  A gradient entry is `g = sum_t tau_t`; reordering the token sum moves it by
  at most `2 (N - 1) u S` with `S = sum_t |tau_t|` (captured, `_term_sums`).
  Each term is a product of per-token values, each the result of a chain of
  feature sums of at most `F` terms (F = the widest feature axis, the
  vocabulary): to first order each sum moves a value by at most `2 F u`
  times its magnitude (terms of one sign, the worst case), so `tau_t` moves
  by at most `2 D F u |tau_t|` with D the number of such sums along a
  token's path (6 per block, 3 for the embedding, final norm, head and loss;
  twice for the backward pass). Hence `|g_mesh - g_one| <= 2 u ((N - 1) +
  D F) S`, and the same for the loss (a mean of N non-negative
  cross-entropies: `S = N * loss`). Quantized operands carry no error term:
  they are bit for bit equal (tests of the quantizers and of dot_general)
  unless a value crossed a rounding boundary: an operand of a Wgrad's
  stochastic rounding that moved by its few ulp above can land on the other
  side of its random threshold. Such an entry of an NVFP4 Wgrad may exceed
  the bound by one code's change (`_term_sums`), and so may an entry of a
  norm scale whose output an NVFP4 Dgrad reads, through that Dgrad's
  stochastic rounding (`_dgrad_flip`); the check counts them (seen: none
  on one x86 CPU, a few on another, and one norm-scale entry on the H200
  host's). Elsewhere a crossing would fail the check: none happens here.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  from train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  one = _trainer(None, gpt_rules)
  state = one.init_state()
  batches = [one.batcher.batch(s).reshape(1, one.cfg.micro_batch, -1)
             for s in (0, 1)]
  n = batches[0].shape[1] * (batches[0].shape[2] - 1)
  depth = 2 * (6 * GPT["num_layers"] + 3)
  factor = 2 * U * ((n - 1) + depth * 256)
  capture = _capture(one)
  grads_fn = jax.jit(one.fns.loss_and_grads)

  def reference(st, step):
    loss, grads = grads_fn(st.params, batches[step], step)
    loss_c, sums, flips = _term_sums(one, capture, st.params, batches[step],
                                     step)
    assert loss_c == float(loss), (loss_c, float(loss))
    return float(loss), _flat(grads), sums, flips
  t0 = time.perf_counter()
  ref0 = reference(state, 0)
  print(f"  one device: loss {ref0[0]:.7f} ({time.perf_counter() - t0:.1f}s"
        f"); tolerance 2u((N-1) + D F) = {factor:.2e} x S with N={n}, "
        f"D={depth}, F=256")
  for path, flip in ref0[3].items():
    if path.endswith("norm/scale"):
      print(f"    {path}: one flipped Dgrad code moves an entry by at most "
            f"{flip.max():.2e} (bound {factor * ref0[2][path].max():.2e})")
  meshes = {}
  for name in names:
    sizes = GPT_MESHES[name]
    t0 = time.perf_counter()
    tr = _trainer(sizes, gpt_rules, train=train)
    if name == "mixed":
      st = tr.init_state()
      for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)  # Every mesh starts alike.
    else:
      st = jax.device_put(state, tr.state_shardings)
    fn = jax.jit(tr.fns.loss_and_grads).lower(
        st.params, tr.put_batch(batches[0]), st.step).compile()
    meshes[name] = (tr, fn)
    loss, grads = fn(st.params, tr.put_batch(batches[0]), st.step)
    dl, worst, flipped = _within(name, loss, grads, ref0, factor)
    print(f"  {name} {sizes}: |dloss| {dl:.2e}, within {100 * worst:.1f}% "
          f"of the bound, {flipped} entries with a flipped code "
          f"({time.perf_counter() - t0:.1f}s)")
    _check_step_collectives(name, fn)
    reshards = _block_reshards(fn, st.params)
    assert not reshards, (name, reshards[:4])
    if (train or {}).get("sequence_parallel"):
      # Activations are gathered and scattered over `model` by design (by
      # the collective matmul's rings inside the NVFP4 layers); XLA
      # exchanges nothing else.
      moved = {c.op for c in shd.collectives(fn) if not c.trivial
               and not (c.op == "collective-permute"
                        and "nvfp4_layer[" in c.line)}
      assert not moved & {"all-to-all", "collective-permute"}, (name, moved)
    elif gpt_rules is GPT_HIGH_PRECISION:
      _check_weights_gathered(name, fn, st.params)
  if not resume:
    return

  # A trained state, checkpointed on one device and resumed on two meshes:
  # the restored state is bit for bit the saved one (resharded), and the
  # next step agrees as above.
  t0 = time.perf_counter()
  trained, _ = jax.jit(one.fns.train_step)(state, batches[0])
  saved = jax.device_get(trained)
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Checkpointer(tmp)
    ckpt.save(1, trained, {"run": "one device"})
    resumed = {name: ckpt.restore(1, meshes[name][0].abstract_state())[0]
               for name in ("mixed", "dp")}
    # And back: the mixed mesh's (sharded) state onto one device.
    ckpt.save(2, resumed["mixed"], {"run": "mesh"})
    back, _ = ckpt.restore(2, one.abstract_state())
    ckpt.close()
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # The fused kernels' layout conversion (`--resume` of a checkpoint of the
  # old layout) on the mixed mesh's sharded state: each array keeps its
  # sharding and equals the host conversion.
  from models import convert_fused_layout  # pylint: disable=g-import-not-at-top
  mcfg = meshes["mixed"][0].model_cfg
  conv = convert_fused_layout(resumed["mixed"], mcfg, "concatenated",
                              "interleaved")
  host = convert_fused_layout(saved, mcfg, "concatenated", "interleaved")
  for a, b, c in zip(jax.tree.leaves(conv), jax.tree.leaves(host),
                     jax.tree.leaves(resumed["mixed"])):
    np.testing.assert_array_equal(np.asarray(a), b)
    assert a.sharding.is_equivalent_to(c.sharding, a.ndim), (a.sharding,
                                                            c.sharding)
  ref1 = reference(trained, 1)
  for name, st in resumed.items():
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(saved)):
      np.testing.assert_array_equal(np.asarray(a), b)
    tr, fn = meshes[name]
    master = st.opt_state.master["block_0"]["mlp"]["up"]["kernel"]
    assert master.sharding.is_equivalent_to(NamedSharding(
        tr.mesh_rules.mesh, tr.mesh_rules.param_spec(
            "block_0/mlp/up/kernel", master.shape)), 2), master.sharding
    loss, grads = fn(st.params, tr.put_batch(batches[1]), st.step)
    dl, worst, flipped = _within(f"resumed on {name}", loss, grads, ref1,
                                 factor)
    print(f"  step 2 resumed on {name}: |dloss| {dl:.2e}, within "
          f"{100 * worst:.1f}% of the bound, {flipped} entries with a flipped"
          f" code; FP32 master of mlp/up split "
          f"{master.sharding.spec}, {master.addressable_shards[0].data.shape}"
          f" per device of {master.shape}")
  print(f"  checkpoint resharded ({time.perf_counter() - t0:.1f}s)")


GPT_HIGH_PRECISION = ((r".*", "bf16"),)


def check_gpt_tp_layout():
  """The GPT's fused kernels on a tensor-parallel mesh (`data=4, model=2`),
  compiled only (one block, every projection in high precision: what
  happens between the layers is XLA's either way): with the "interleaved"
  layout (the default) XLA adds no collective inside attention or the MLP
  (`_block_reshards`); with the "concatenated" layout of earlier versions
  the same check finds the reshards (all-to-all, collective-permute), so
  it fails where the layout does not split by heads. `check_gpt_step`
  runs the NVFP4 step on `model=2` and mixed meshes against one device."""
  for layout in ("interleaved", "concatenated"):
    t0 = time.perf_counter()
    tr = _trainer(GPT_MESHES["tp"], GPT_HIGH_PRECISION, num_layers=1,
                  fused_layout=layout)
    st = jax.eval_shape(tr.fns.init_state)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=sh), st.params, tr.state_shardings.params)
    batch = jax.ShapeDtypeStruct(
        (1, tr.cfg.micro_batch, tr.cfg.seq_len + 1), jnp.int32,
        sharding=NamedSharding(tr.mesh_rules.mesh,
                               tr.mesh_rules.batch_spec(3, axis=1)))
    fn = jax.jit(tr.fns.loss_and_grads).lower(
        params, batch, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    reshards = _block_reshards(fn, st.params)
    kinds = sorted({r.split()[0] for r in reshards})
    print(f"  {layout}: {len(reshards)} reshards in attention and MLP "
          f"{kinds} ({time.perf_counter() - t0:.1f}s)")
    if layout == "interleaved":
      assert not reshards, reshards
    else:
      assert "all-to-all" in kinds or "collective-permute" in kinds, kinds


def check_gpt_step_high_precision_fsdp():
  """`check_gpt_step` on the FSDP mesh with every projection in high
  precision (XLA partitions the whole step): equal to one device within
  the same bound, and its collectives move weights, not activations
  (`_check_weights_gathered`)."""
  check_gpt_step(("fsdp",), resume=False, gpt_rules=GPT_HIGH_PRECISION)


def check_gpt_step_fsdp_tp():
  """`check_gpt_step` on the pure FSDP and tensor-parallel meshes."""
  check_gpt_step(("fsdp", "tp"), resume=False)


def check_gpt_step_sequence_parallel():
  """`check_gpt_step` on the tensor-parallel and mixed meshes with sequence
  parallelism (`TrainConfig(sequence_parallel=True)`; on the mixed mesh
  also with `collective_matmul=True`): within the same derived bound of
  one device. The compiled step reduce-scatters the
  row-parallel outputs and column-parallel input gradients over `model`
  instead of all-reducing them, and runs the norms on token shards: the
  RMSNorm's square-sum over features reads `[tokens / (data x model),
  d_model]` per device (`_norm_rows`)."""
  check_gpt_step(("tp", "mixed"), resume=False,
                 train={"sequence_parallel": True})
  # Every projection in high precision: XLA partitions the layers from the
  # sharding constraints (`dot_general._sequence_constraint`).
  check_gpt_step(("tp",), resume=False, gpt_rules=GPT_HIGH_PRECISION,
                 train={"sequence_parallel": True})
  # With the collective matmul's rings in the quantized layers.
  check_gpt_step(("mixed",), resume=False,
                 train={"sequence_parallel": True, "collective_matmul": True})
  sizes = GPT_MESHES["tp"]
  rows = {}
  for seq in (False, True):
    tr = _trainer(sizes, train={"sequence_parallel": seq})
    st = tr.init_state()
    batch = tr.batcher.batch(0).reshape(1, tr.cfg.micro_batch, -1)
    fn = jax.jit(tr.fns.loss_and_grads).lower(
        st.params, tr.put_batch(batch), st.step).compile()
    rows[seq] = _norm_rows(fn, batch.shape[-1] - 1)
  per_device = 8 // sizes["data"]  # The trainer's batch of 8 sequences.
  assert rows == {False: per_device, True: per_device // sizes["model"]}, rows
  print(f"  tp: RMSNorm on {rows[False]} sequences per device, "
        f"{rows[True]} with sequence parallelism")


def _norm_rows(compiled, seq: int) -> int:
  """The sequences per device a compiled GPT step's first RMSNorm
  (`block_0/attn_norm`) computes on: the leading dimension of its 3-D FP32
  values `[batch, seq, d_model]` per device."""
  rows = set()
  for line in compiled.as_text().splitlines():
    name = re.search(r'op_name="([^"]*)"', line)
    shape = re.search(r"= f32\[(\d+),(\d+),(\d+)\]", line)
    if (name and shape and "block_0/attn_norm" in name.group(1)
        and int(shape.group(2)) == seq):
      rows.add(int(shape.group(1)))
  assert len(rows) == 1, rows
  return rows.pop()


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
    # "ragged"; on CPU devices `moe.ragged_all_to_all`'s all-gather form),
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
  """`moe.ragged_all_to_all`'s CPU form against the semantics JAX documents
  for `jax.lax.ragged_all_to_all` (slice `i` to device `i // per`, at the
  receiver's row `output_offsets[i]`), written out in NumPy: a 2 x 4 mesh
  exchanging over its second axis, two slices per receiver, empty slices
  included; rows nobody writes keep the output's."""
  from nvfp4_jax.training import moe  # pylint: disable=g-import-not-at-top
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
    return moe.ragged_all_to_all(o[0], out[0], of[0], sz[0], pl[0], sz[0],
                                 "expert", "cpu")[None]
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


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_") and callable(fn)
          and name not in ("check_within", "check_dot_general",
                           "check_collectives")}


def main(names):
  """Runs the checks `names` in order, each after the others' failures too
  (`tests/sharding/test_mesh.py` runs several tests' checks in one process): prints
  `[NAME]`, what it measured and `[NAME] ok in ...` or `[NAME] FAILED` with
  the traceback; exits with status 1 if any failed."""
  import traceback  # pylint: disable=g-import-not-at-top
  assert len(jax.devices()) == 8, jax.devices()
  failed = []
  for name in names:
    t0 = time.perf_counter()
    print(f"[{name}]", flush=True)
    try:
      CHECKS[name]()
    except Exception:  # pylint: disable=broad-except
      failed.append(name)
      print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
    else:
      print(f"[{name}] ok in {time.perf_counter() - t0:.1f}s", flush=True)
  if failed:
    sys.exit(f"mesh checks failed: {' '.join(failed)}")


if __name__ == "__main__":
  main(sys.argv[1:] or list(CHECKS))
