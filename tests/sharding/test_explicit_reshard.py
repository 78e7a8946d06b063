"""Sharding in types, as forgiving as auto mode (issue 58, item 4).

Under `jax.set_mesh` with Explicit axes an NVFP4 layer reads its split from
its operands' types. Where that split would cut a block of an operand (a
token shard that is not a multiple of the Wgrad operands' 16-token blocks, a
weight's `in` split that cuts 16x16 tiles), the layer runs on the closest
split that cuts none (`LinearSharding.fitted`: the operands all-gathered
over the offending axis), and the result is resharded back to the types'
split: it equals one device's, as in auto mode. A split that cuts nothing
runs as before: no gather appears.

`LinearSharding.fitted` is checked here on abstract meshes. The layer and a
model on 8 host CPU devices are checked by `tests/sharding/test_mesh.py`
(`test_explicit_reshard*`: `tests/support/mesh_checks/explicit_reshard.py`
derives the tolerances): the device count is set before jax is imported,
and a pytest worker has imported jax already.
"""

from __future__ import annotations

import pytest
from jax.sharding import AxisType



def _fit_cases():
  """`(sharding, tokens, k, n, recipe, expected changes or None: kept)`
  on abstract meshes (no devices needed)."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  from jax.sharding import AbstractMesh  # pylint: disable=g-import-not-at-top

  def mesh(**sizes):
    return AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Explicit,) * len(sizes))
  ls = nv.sharding.LinearSharding
  nvfp4 = nv.Recipe.nvfp4()
  dp = ls(mesh=mesh(batch=4, fsdp=2), tokens=("batch", "fsdp"), fsdp="fsdp")
  row = ls(mesh=mesh(batch=4, model=2), tokens=("batch",), tensor="row",
           model="model")
  col = ls(mesh=mesh(data=2, fsdp=2, model=2), tokens=("data", "fsdp"),
           tensor="column", model="model", fsdp="fsdp")
  seq = ls(mesh=mesh(data=4, model=2), tokens=("data",), tensor="column",
           model="model", sequence=True)
  return {
      # 17 tokens a shard: no token axis keeps whole blocks; `fsdp` goes
      # with the tokens it split.
      "17 per shard": (dp, 136, 64, 48, nvfp4, dict(tokens=(), fsdp=None)),
      # 24 a shard over both axes, 48 over `batch` (the major) alone.
      "24 per shard": (dp, 192, 64, 48, nvfp4,
                       dict(tokens=("batch",), fsdp=None)),
      "32 per shard": (dp, 256, 64, 48, nvfp4, None),
      # A row-parallel `in` of 24 a shard cuts X's blocks and the tiles.
      "row in=48": (row, 256, 48, 64, nvfp4, dict(tensor=None, model=None)),
      "row in=64": (row, 256, 64, 64, nvfp4, None),
      # FSDP on `in` (24 rows a shard) cuts tiles; `model` on `out` keeps
      # its 32 columns a shard.
      "fsdp in=48": (col, 256, 48, 64, nvfp4, dict(fsdp=None)),
      # Sequence parallelism: 24 tokens a shard over data x model.
      "sequence": (seq, 192, 64, 64, nvfp4, dict(sequence=False)),
      # Nothing blocked in BF16: any even split is kept.
      "bf16": (dp, 136, 64, 48, nv.Recipe.bf16(), None),
  }


@pytest.mark.parametrize("case", list(_fit_cases()))
def test_fitted_split_keeps_every_block_whole(case):
  """`LinearSharding.fitted` drops exactly the axes that would cut a block
  (minor token axes first, as auto mode's `fit_spec`), keeps a split that
  cuts none as it is (the same object: the layer's fast path unchanged),
  and what it returns passes `check`."""
  sh, tokens, k, n, recipe, changes = _fit_cases()[case]
  got = sh.fitted(recipe, tokens, k, n)
  if changes is None:
    assert got is sh
  else:
    with pytest.raises(ValueError, match="straddle"):
      sh.check(recipe, tokens, k, n)
    for field, value in changes.items():
      assert getattr(got, field) == value, (field, got)
    for field in ("tokens", "tensor", "model", "fsdp", "sequence"):
      if field not in changes:
        assert getattr(got, field) == getattr(sh, field), (field, got)
  got.check(recipe, tokens, k, n)


