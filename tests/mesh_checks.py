"""Mesh checks on 8 host CPU devices: `python tests/mesh_checks.py NAME...`.

`tests/test_mesh.py` runs each check in a fresh process: the device count is
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
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def gemm_bound(a, b, n):
  """Bound on |sharded - single| of `a @ b.T` (see the module docstring)."""
  da, db = jax.jit(lambda a, b: (nv.dequantize(a), nv.dequantize(b)))(a, b)
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
  cs = shd.collectives(compiled)
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


def check_dot_general(impl, names):
  m = mesh(data=2, fsdp=2, model=2)
  t, k, n = 128, 64, 96
  x = jnp.asarray(make_heavy_tailed((t, k), seed=1))
  w = jnp.asarray(make_heavy_tailed((k, n), seed=2)) * 0.01
  dy = jnp.asarray(make_heavy_tailed((t, n), seed=3))
  key = jax.random.key(7)
  recipe = nv.Recipe.nvfp4()

  def compiled(sharding):
    def f(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: nv.dot_general(
          x, w, DN, recipe=recipe, key=key, sharding=sharding), x, w)
      return (y, *vjp(dy))
    specs = ((P(), P(), P()) if sharding is None else
             (sharding.x_spec, sharding.kernel_spec, sharding.y_spec))
    args = [jax.device_put(a, NamedSharding(m, s))
            for a, s in zip((x, w, dy), specs)]
    with nv.default_implementation(impl):
      c = jax.jit(f).lower(*args).compile()
    return c, c(*args)

  _, (y0, dx0, dw0) = compiled(None)
  qx, qxt, qdy, qdyt, qw = _operands(recipe, x, w, dy, key)
  bounds = {"y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n),
            "dw": gemm_bound(qxt, qdyt, t)}
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


def check_dot_general_xla():
  check_dot_general("xla", ("data", "fsdp", "column+fsdp", "row+fsdp"))


def check_dot_general_pallas():
  check_dot_general("pallas", ("column+fsdp", "row+fsdp"))


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_") and callable(fn)
          and name not in ("check_within", "check_dot_general",
                           "check_collectives")}


def main(names):
  assert len(jax.devices()) == 8, jax.devices()
  for name in names:
    t0 = time.perf_counter()
    print(f"[{name}]")
    CHECKS[name]()
    print(f"[{name}] ok in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or list(CHECKS))
