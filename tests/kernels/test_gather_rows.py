"""`nvfp4_jax.ops.gather_rows`: the Pallas kernel (interpreted here,
compiled on a GPU) equals the reference bit for bit (a gather copies: no
arithmetic), rows with no source are zeros, and the MoE permutation runs
it on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.core import dispatch
from nvfp4_jax.training import moe_routing
from nvfp4_jax.ops.gather_rows import pallas_triton
from nvfp4_jax.ops.gather_rows import reference
from nvfp4_jax.ops.gather_rows.api import gather_rows

ON_GPU = jax.default_backend() == "gpu"


def _case(rows, d, m, dtype, seed=0):
  rng = np.random.RandomState(seed)
  # Heavy-tailed values (a gather must copy any bits: Inf and NaN too).
  x = rng.standard_t(2, size=(rows, d)).astype(np.float32)
  x[0, :3] = [np.inf, -np.inf, np.nan]
  # Indices inside, at and past the end, and negative: no row for the last two.
  index = rng.randint(-3, rows + 5, size=m).astype(np.int32)
  index[:3] = [rows, -1, rows - 1][:m]
  return jnp.asarray(x, dtype), jnp.asarray(index)


@pytest.mark.parametrize("rows,d,m,dtype", [
    (100, 300, 77, jnp.bfloat16),      # Neither axis a tile multiple.
    (64, 512, 32, jnp.bfloat16),       # Exactly one tile.
    (33, 1408, 50, jnp.float32),       # Several column tiles.
    (8, 16, 1, jnp.float16),
])
def test_kernel_equals_reference(rows, d, m, dtype):
  x, index = _case(rows, d, m, dtype)
  want = np.asarray(reference.gather_rows(x, index), np.float32)
  got = np.asarray(pallas_triton.gather_rows(x, index), np.float32)
  np.testing.assert_array_equal(got, want)        # NaN where NaN.
  none = (np.asarray(index) < 0) | (np.asarray(index) >= rows)
  assert none.any() and not np.any(got[none])    # No source: zeros.
  src = np.asarray(index)[~none]
  np.testing.assert_array_equal(got[~none],
                                np.asarray(x, np.float32)[src])


def test_api_carries_trailing_axes_and_checks_its_index():
  x = jnp.arange(5 * 2 * 3, dtype=jnp.float32).reshape(5, 2, 3)
  index = jnp.asarray([4, 0, 7, 2], jnp.int32)
  for impl in ("xla", "pallas"):
    got = gather_rows(x, index, implementation=impl)
    assert got.shape == (4, 2, 3)
    np.testing.assert_array_equal(got[2], 0)
    np.testing.assert_array_equal(got[0], x[4])
  with pytest.raises(ValueError, match="int32.*astype"):
    gather_rows(x, index.astype(jnp.float32))
  with pytest.raises(ValueError, match="row axis"):
    gather_rows(jnp.float32(1), index)


@pytest.mark.skipif(ON_GPU, reason="traces the GPU path on a CPU machine")
def test_moe_permutation_runs_the_kernel_on_gpus():
  """The dispatch's forward and backward gathers are the kernel where the
  platform is a GPU (the jaxpr names it), the reference elsewhere."""
  # Shapes of this test alone: jax caches traces per shape, not platform.
  x = jax.random.normal(jax.random.key(0), (24, 40), jnp.bfloat16)
  r = moe_routing.route(jax.random.normal(jax.random.key(1), (24, 4)), 2)
  grad = jax.grad(
      lambda x: moe_routing.dispatch(x, r, 2).astype(jnp.float32).sum())
  with dispatch.target_device("gpu", (9, 0)):
    jaxpr = str(jax.make_jaxpr(grad)(x))
  assert "nvfp4_gather_rows" in jaxpr and jaxpr.count("pallas_call[") == 2
  from nvfp4_jax.ops.gather_rows.api import GATHER_ROWS  # pylint: disable=g-import-not-at-top
  assert GATHER_ROWS.order() == ("xla",)     # On this CPU: the reference.
