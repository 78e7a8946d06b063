"""Runs the mesh checks (`tests/support/mesh_checks`) in a process of their
own and reads their output.

The checks need 8 host CPU devices, whose count is fixed in `XLA_FLAGS`
before jax is imported, and a pytest worker has imported jax: so they run as
`python -m mesh_checks NAME...`. The fast tier's checks (`FAST`) run in one
process for the session (`conftest.mesh_fast_checks`): a process of its own
for each test would start jax and this library again (~5 s of CPU each) and
compile again the one-device layers that several checks compare against.
Each test reads its own checks' output (`section`) and fails if one of them
failed; a failed check does not stop the others (`mesh_checks.main`).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"

# The fast tier's checks (tests/sharding/test_mesh.py reads them all, so that
# under `--dist loadfile` one worker runs this process).
FAST = ("quantize", "errors", "dot_general_xla", "user_mesh_quick",
        "auto_kernels_quick", "auto_moe_quick", "auto_gather_rows",
        "wgrad_schedule", "dot_general_pallas", "gpt_tp_layout",
        "ragged_all_to_all_model", "moe_expert_parallel",
        "layer_tokens", "layer_tile")


def _process(names, timeout):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(SUPPORT), str(ROOT)] + [p for p in os.environ.get(
          "PYTHONPATH", "").split(os.pathsep) if p]))
  return subprocess.run([sys.executable, "-m", "mesh_checks", *names],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def run_checks(*names: str, timeout: int = 600) -> str:
  """Runs the checks `names` in a fresh process and returns its output;
  fails the test if one of them failed."""
  proc = _process(names, timeout)
  if proc.returncode:
    pytest.fail(f"mesh checks {names} failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
  print(proc.stdout)
  return proc.stdout


def run_fast(timeout: int = 900) -> tuple[str, str]:
  """`(stdout, stderr)` of one process running `FAST`."""
  proc = _process(FAST, timeout)
  return proc.stdout, proc.stderr


def section(fast: tuple[str, str], *names: str) -> str:
  """The output of the checks `names` (in `FAST`), each from its `[NAME]`
  line to its `[NAME] ok` line; fails the test if one of them failed."""
  stdout, stderr = fast
  parts = []
  for name in names:
    assert name in FAST, name
    start = stdout.find(f"[{name}]\n")
    end = stdout.find(f"[{name}] ok in ", start)
    if start < 0 or end < 0:
      pytest.fail(f"mesh check {name} failed:\n"
                  f"{stdout[max(start, 0):][:6000]}\n{stderr[-6000:]}")
    parts.append(stdout[start:end])
  print("".join(parts))
  return "".join(parts)
