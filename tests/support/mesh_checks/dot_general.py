"""`nv.dot_general` forward and gradients on every kind of split
(`MeshRules`' layouts), and the opt-in knobs of `LinearSharding`."""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd
from conftest import make_heavy_tailed
from mesh_checks.common import DN, check_within, gemm_bound, mesh
from mesh_checks.common import dequantize_pair


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
def layer_operands(recipe, x, w, dy, key):
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
WHOLE_LAYER = {}


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
  qx, qxt, qdy, qdyt, qw = layer_operands(recipe, x, w, dy, key)
  bounds = {"y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n),
            "dw": gemm_bound(qxt, qdyt, t)}
  if impl == "xla" and residuals == "codes":  # For `check_user_mesh`.
    WHOLE_LAYER["codes"] = (y0, dx0, dw0, bounds)
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
  qx, _, qdy, _, qw = layer_operands(recipe, x, w, dy, key)
  sizes = {"y": (qx, qw, k), "dx": (qdy, qw.T, n)}
  shardings = _linear_shardings(m)
  for name, what in (("row+fsdp", "y"), ("column+fsdp", "dx")):
    a, b, depth = sizes[what]
    da, db = dequantize_pair(a, b)
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
      layer_operands(recipe, part(x, i), w, part(dy, i), key) for i in range(4))])
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
  qx, _, qdy, _, qw = layer_operands(recipe, x, w, dy, key)
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
  qx, _, qdy, _, qw = layer_operands(recipe, x, w, dy, key)
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
  from mesh_checks.gpt_step import GPT_MESHES, gpt_trainer  # pylint: disable=g-import-not-at-top
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
  _, qxt, _, qdyt, _ = layer_operands(recipe, x, w, dy, key)
  da, db = dequantize_pair(qxt, qdyt)
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
    tr = gpt_trainer(GPT_MESHES["fsdp"], train=dict(wgrad_sums=sums))
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
