"""Quantization of a sharded tensor: codes, scales and amax equal the
whole tensor's; a split block raises."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd
from conftest import make_heavy_tailed
from mesh_checks.common import DN, IMPLS, assert_same_q, mesh


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
