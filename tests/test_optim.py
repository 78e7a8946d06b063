"""FP32 master weights as an optax transformation (issue 3)."""

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
  jax.tree.map(np.testing.assert_array_equal, p1, p2)


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
  jax.tree.map(np.testing.assert_array_equal, p1, params)  # Accumulating.
  jax.tree.map(np.testing.assert_array_equal, nv.master_params(state), m0)
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
  jax.tree.map(np.testing.assert_array_equal, p2, params)
  jax.tree.map(np.testing.assert_array_equal, nv.master_params(state), m1)
  assert int(state.notfinite_count) == 1


def test_errors():
  tx = nv.master_weights(optax.sgd(1.0))
  params = _params(jnp.float32)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="no MasterWeightsState"):
    nv.master_params(optax.sgd(1.0).init(params))
