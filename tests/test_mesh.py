"""Training on a device mesh (issue 11), on 8 host CPU devices.

Each check runs in a fresh process (`tests/mesh_checks.py`, which documents
the derived tolerances): the host device count must be set in `XLA_FLAGS`
before jax is imported, and pytest workers have imported it. Checked:
sharded quantization (1x16, 16x16, RHT, SR; reference and Pallas kernels)
equals the whole tensor's bit for bit; a split block raises an error naming
the dimension and the mesh axes; `dot_general` forward and gradients on data,
FSDP and tensor-parallel splits equal the single-device results within the
derived FP32 reduction-order bound; the compiled programs all-gather only
quantized weight bytes (uint8), never activations.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_checks(*names: str, timeout: int = 600) -> str:
  """Runs `tests/mesh_checks.py NAME...` and returns its output."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
          os.pathsep) if p]))
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "mesh_checks.py"), *names],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    pytest.fail(f"mesh checks {names} failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
  print(proc.stdout)
  return proc.stdout


def test_sharded_quantizers_equal_whole_tensor_and_split_blocks_raise():
  out = run_checks("quantize", "errors")
  assert "straddle" in out


def test_sharded_dot_general_reference():
  out = run_checks("dot_general_xla")
  assert "3.97x fewer" in out  # FSDP weights travel as 4-bit codes.


def test_sharded_dot_general_pallas():
  run_checks("dot_general_pallas")
