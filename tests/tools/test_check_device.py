"""`python -m nvfp4_jax.tools.check_device` runs (small, on CPU) and reports."""

import pytest

from nvfp4_jax.tools import check_device


@pytest.mark.slow  # Every kernel and benchmark path once (~20 s on CPU).
def test_check_device_smoke(capsys):
  check_device.main(["--small", "--no-step"])
  out = capsys.readouterr().out
  for section in ("block_scaled_matmul", "## Exactness", "## GEMM vs cuBLAS",
                  "## Layer"):
    assert section in out
  assert "DIFFERS" not in out and "OUTSIDE" not in out
  assert "quantize_pair (dY: SR + RHT) | exact" in out
