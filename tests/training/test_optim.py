"""FP32 master weights as an optax transformation (issue 3)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nvfp4_jax as nv


def _params(dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (16, 8)).astype(dtype),
          "b": {"bias": jax.random.normal(k2, (8,)).astype(dtype)}}


def _grads(params, i):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(i), p.shape).astype(p.dtype),
      params)


def test_tiny_updates_accumulate_in_master_for_bf16_params():
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  tx = nv.master_weights(optax.sgd(1e-4))
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update({"w": jnp.ones((4,), jnp.bfloat16)}, s, p))
  for _ in range(30):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        params["w"], nv.master_params(state)["w"].astype(jnp.bfloat16))
  master = nv.master_params(state)["w"]
  assert master.dtype == jnp.float32
  np.testing.assert_allclose(master, 1 - 30e-4, rtol=1e-5)
  # Without the master, each update is below half a bf16 ulp and is lost.
  plain = {"w": jnp.ones((4,), jnp.bfloat16)}
  plain_tx = optax.sgd(1e-4)
  ps = plain_tx.init(plain)
  for _ in range(30):
    u, ps = plain_tx.update({"w": jnp.ones((4,), jnp.bfloat16)}, ps, plain)
    plain = optax.apply_updates(plain, u)
  np.testing.assert_array_equal(plain["w"], 1.0)
  assert not np.all(np.asarray(params["w"]) == 1.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_apply_updates_gives_exactly_the_cast_master(dtype):
  params = _params(dtype)
  # Ordinary steps: every weight moves by less than its magnitude.
  tx = nv.master_weights(optax.adamw(1e-3, weight_decay=0.1))
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(5):
    updates, state = update(_grads(params, i), state, params)
    params = optax.apply_updates(params, updates)
    master = nv.master_params(state)
    jax.tree.map(lambda p, m: np.testing.assert_array_equal(
        p, m.astype(p.dtype)), params, master)


def test_f32_params_match_the_inner_optimizer():
  params = _params(jnp.float32)
  inner = optax.adam(1e-2)
  tx = nv.master_weights(inner)
  s1, s2 = tx.init(params), inner.init(params)
  p1 = p2 = params
  for i in range(3):
    g = _grads(params, i)
    u1, s1 = tx.update(g, s1, p1)
    u2, s2 = inner.update(g, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  chex.assert_trees_all_equal(p1, p2)


def test_grads_reach_inner_in_fp32():
  seen = []

  def record():
    def init(params):
      return optax.EmptyState()

    def update(updates, state, params=None):
      seen.append(jax.tree.map(lambda u: u.dtype, updates))
      seen.append(jax.tree.map(lambda p: p.dtype, params))
      return updates, state
    return optax.GradientTransformation(init, update)
  params = _params(jnp.bfloat16)
  tx = nv.master_weights(record())
  tx.update(_grads(params, 0), tx.init(params), params)
  assert set(jax.tree.leaves(seen)) == {jnp.dtype(jnp.float32)}


def test_composes_with_chain_clip_multisteps():
  params = _params(jnp.bfloat16)
  tx = optax.MultiSteps(
      nv.master_weights(optax.chain(optax.clip_by_global_norm(1.0),
                                    optax.adamw(1e-2))), every_k_schedule=2)
  state = tx.init(params)
  m0 = nv.master_params(state)
  updates, state = tx.update(_grads(params, 0), state, params)
  p1 = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(p1, params)  # Accumulating.
  chex.assert_trees_all_equal(nv.master_params(state), m0)
  updates, state = tx.update(_grads(params, 1), state, p1)
  p2 = optax.apply_updates(p1, updates)
  m2 = nv.master_params(state)
  assert not np.allclose(m2["w"], m0["w"])
  jax.tree.map(lambda p, m: np.testing.assert_array_equal(p, m.astype(p.dtype)),
               p2, m2)
  # Clipping happened in FP32 on the averaged gradient: step norm is bounded.
  delta = jax.tree.map(lambda a, b: a - b, m2, m0)
  assert optax.global_norm(delta) < 1e-2 * np.sqrt(136) * 1.01


def test_apply_if_finite_skips_nan_without_touching_master():
  params = _params(jnp.bfloat16)
  tx = optax.apply_if_finite(nv.master_weights(optax.adam(1e-2)),
                             max_consecutive_errors=3)
  state = tx.init(params)
  updates, state = tx.update(_grads(params, 0), state, params)
  params = optax.apply_updates(params, updates)
  m1 = nv.master_params(state)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(params, 1))
  updates, state = tx.update(bad, state, params)
  p2 = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(p2, params)
  chex.assert_trees_all_equal(nv.master_params(state), m1)
  assert int(state.notfinite_count) == 1


def test_errors():
  tx = nv.master_weights(optax.sgd(1.0))
  params = _params(jnp.float32)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="no MasterWeightsState"):
    nv.master_params(optax.sgd(1.0).init(params))


def _complex_tree():
  """A complex64 weight, a complex64 bias and a float32 weight, and their
  gradients for step `i` (both parts random)."""
  def cplx(key, shape):
    re, im = jax.random.normal(key, (2,) + shape)
    return (re + 1j * im).astype(jnp.complex64)
  keys = jax.random.split(jax.random.key(3), 3)
  params = {"c": cplx(keys[0], (16, 8)), "b": {"bias": cplx(keys[1], (8,))},
            "w": jax.random.normal(keys[2], (8, 4), jnp.float32)}
  grads = lambda i: jax.tree.map(
      lambda p: (cplx(jax.random.key(100 + i), p.shape) if jnp.iscomplexobj(p)
                 else jax.random.normal(jax.random.key(200 + i), p.shape)),
      params)
  return params, grads


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_complex_params_match_the_inner_optimizer(inner):
  """Complex64 parameters keep a complex64 master (never a real one, which
  would drop the imaginary part): steps equal optax's own, bit for bit, on
  a tree that mixes complex64 and float32 leaves (and, beside them, an
  integer counter that stays untouched). Bit for bit, as for float32
  parameters: the master and the parameter are one dtype, and
  `p + (new - p)` is `new` for steps smaller than the weight."""
  make = {"sgd": lambda: optax.sgd(1e-2, momentum=0.9),
          "adam": lambda: optax.adam(1e-2)}[inner]
  params, grads = _complex_tree()
  tx, ref = nv.master_weights(make()), make()
  p1 = dict(params, n=jnp.int32(7))
  s1, s2, p2 = tx.init(p1), ref.init(params), params
  master = nv.master_params(s1)
  assert master["c"].dtype == jnp.complex64 and master["w"].dtype == jnp.float32
  # Eager, as optax beside it: one jitted program may contract a product
  # and a sum into an FMA where the other does not (1 ulp in adam).
  for i in range(3):
    g = grads(i)
    u1, s1 = tx.update(dict(g, n=jnp.int32(1)), s1, p1)
    u2, s2 = ref.update(g, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  assert int(p1.pop("n")) == 7
  chex.assert_trees_all_equal(p1, p2)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)),
               p1, {k: v for k, v in nv.master_params(s1).items() if k != "n"})
  assert np.all(np.asarray(p1["c"]).imag != np.asarray(params["c"]).imag)


def test_the_issue_s_complex_sgd_step():
  """`1+1j` with gradient `1j` and learning rate 0.1 steps to `1+0.9j`, as
  `optax.sgd` gives (a real master gave back `1+1j`)."""
  p = {"c": jnp.array([1 + 1j], jnp.complex64)}
  g = {"c": jnp.array([1j], jnp.complex64)}
  tx = nv.master_weights(optax.sgd(0.1))
  u, _ = tx.update(g, tx.init(p), p)
  u_ref, _ = optax.sgd(0.1).update(g, optax.sgd(0.1).init(p), p)
  np.testing.assert_array_equal(optax.apply_updates(p, u)["c"],
                                optax.apply_updates(p, u_ref)["c"])
  np.testing.assert_allclose(optax.apply_updates(p, u)["c"], [1 + 0.9j])


def test_complex128_and_float64_keep_their_precision_with_x64():
  """With `jax_enable_x64`, complex128 and float64 parameters keep masters
  of their own dtype (`master_dtype`: at least FP32, never narrower), so a
  step below FP32's resolution still lands, as with optax alone."""
  with jax.enable_x64(True):
    p = {"c": jnp.array([1 + 1j], jnp.complex128),
         "w": jnp.array([1.0], jnp.float64)}
    g = {"c": jnp.array([1e-9j], jnp.complex128),
         "w": jnp.array([1e-9], jnp.float64)}
    tx, ref = nv.master_weights(optax.adam(1e-9)), optax.adam(1e-9)
    s = tx.init(p)
    assert {k: v.dtype for k, v in nv.master_params(s).items()} == {
        "c": jnp.complex128, "w": jnp.float64}
    u, _ = tx.update(g, s, p)
    u_ref, _ = ref.update(g, ref.init(p), p)
    got, want = optax.apply_updates(p, u), optax.apply_updates(p, u_ref)
    chex.assert_trees_all_equal(got, want)
    assert float(got["w"][0]) != 1.0 and float(got["c"][0].imag) != 1.0


def test_complex_gradient_of_a_real_parameter_is_an_error():
  tx = nv.master_weights(optax.sgd(1.0))
  p = {"w": jnp.ones((3,), jnp.float32)}
  with pytest.raises(TypeError, match=r"real float32 parameter of shape "
                     r"\(3,\) got a complex gradient \(complex64\)"):
    tx.update({"w": jnp.ones((3,), jnp.complex64)}, tx.init(p), p)
