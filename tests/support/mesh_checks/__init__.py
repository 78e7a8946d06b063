"""Mesh checks on 8 host CPU devices: `python -m mesh_checks NAME...`.

Run with `tests/support` on the path (`tests/sharding/test_mesh.py` runs
them in a fresh process, `mesh_run`): the device count is fixed by
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax is imported,
and a pytest worker has imported jax already. Importing this package sets
it, so it must come before jax. Each check raises AssertionError on a
failure and prints what it measured; `main` runs several and reports each.

The checks, one module per subject (each module's docstring says what it
holds and derives its tolerances; `common` the sharded GEMM's FP32 bound):

- `quantize`: sharded quantization equals the whole tensor's;
- `dot_general`: the layer on `MeshRules`' layouts and the opt-in knobs;
- `user_mesh`: sharding in types (Explicit axes) on the user's mesh;
- `explicit_reshard`: splits that would cut a block, fitted and resharded;
- `auto`: auto mode with the Pallas kernels per shard;
- `moe`: the grouped ops and the MoE layer, expert parallelism;
- `third_party`: the vendored models switched in one call, sharded;
- `gpt_step`: a GPT train step on DP, FSDP, TP and mixed meshes.
"""

from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
  raise RuntimeError("mesh_checks must set XLA_FLAGS before importing jax.")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

# tests/support (this package and the helpers), tests (`conftest`),
# tests/flax (`test_third_party`'s models) and the repository root.
_SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.dirname(os.path.dirname(_SUPPORT)),
              os.path.join(os.path.dirname(_SUPPORT), "flax"),
              os.path.dirname(_SUPPORT), _SUPPORT):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import time  # noqa: E402

import jax  # noqa: E402

from mesh_checks import auto  # noqa: E402
from mesh_checks import dot_general  # noqa: E402
from mesh_checks import explicit_reshard  # noqa: E402
from mesh_checks import gpt_step  # noqa: E402
from mesh_checks import moe  # noqa: E402
from mesh_checks import quantize  # noqa: E402
from mesh_checks import third_party  # noqa: E402
from mesh_checks import user_mesh  # noqa: E402

_MODULES = (quantize, dot_general, user_mesh, explicit_reshard, auto, moe,
            third_party, gpt_step)
# Functions named `check_*` that are helpers, not checks.
_HELPERS = ("check_within", "check_dot_general")

CHECKS = {name[len("check_"):]: fn for module in _MODULES
          for name, fn in vars(module).items()
          if name.startswith("check_") and callable(fn)
          and getattr(fn, "__module__", None) == module.__name__
          and name not in _HELPERS}


def main(names):
  """Runs the checks `names` in order, each after the others' failures too
  (`tests/sharding/test_mesh.py` runs several tests' checks in one process):
  prints `[NAME]`, what it measured and `[NAME] ok in ...` or `[NAME]
  FAILED` with the traceback; exits with status 1 if any failed."""
  import traceback  # pylint: disable=g-import-not-at-top
  assert len(jax.devices()) == 8, jax.devices()
  unknown = [n for n in names if n not in CHECKS]
  if unknown:
    sys.exit(f"unknown mesh checks {unknown}; known: {sorted(CHECKS)}")
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
