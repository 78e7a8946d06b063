"""`nv.dot_general` under the user's own mesh: sharding in types
(Explicit axes) on every layout."""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd
from conftest import make_heavy_tailed
from mesh_checks.common import DN, check_within, gemm_bound
from mesh_checks.dot_general import WHOLE_LAYER, layer_operands


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
  if "codes" not in WHOLE_LAYER:
    def whole(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: nv.dot_general(x, w, DN, recipe=recipe,
                                                   key=key), x, w)
      return (y, *vjp(dy))
    y0, dx0, dw0 = jax.jit(whole)(x.reshape(t, k), w, dy.reshape(t, n))
    qx, qxt, qdy, qdyt, qw = layer_operands(recipe, x.reshape(t, k), w,
                                       dy.reshape(t, n), key)
    WHOLE_LAYER["codes"] = (y0, dx0, dw0, {
        "y": gemm_bound(qx, qw, k), "dx": gemm_bound(qdy, qw.T, n),
        "dw": gemm_bound(qxt, qdyt, t)})
  y0, dx0, dw0, bounds = WHOLE_LAYER["codes"]
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
  readme = pathlib.Path(__file__).resolve().parents[3] / "docs" / "sharding.md"
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
