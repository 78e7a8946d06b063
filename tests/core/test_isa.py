"""The numerics are the same on every CPU: key bit-exactness checks re-run
under other XLA:CPU code generation (issue 58).

XLA:CPU's floating-point results can depend on the host: the instruction set
it compiles for (`--xla_cpu_max_isa`: with FMA, LLVM may contract a product
and a sum, `xla_cpu` allowing it) and the library it hands a dot to, which
follows the CPU it finds at run time, not that flag (YNNPACK on this
project's AVX-512 machines; on an AVX2-only CI machine the FP32 dot of the
former RHT reference ran XLA's own loops: an `fma` chain whose flushed
products left zeros of the last product's sign, codes 8 and 128 where the
kernels give 0). Neither can be changed once JAX has started, so each
configuration runs the checks in a process of its own:

- `AVX2, own dots`: AVX2 code generation with XLA's own dot loops
  (`--xla_cpu_experimental_ynn_fusion_type=` turns YNNPACK's fusions off),
  what an AVX2-only host computes;
- `AVX`: no FMA, so nothing is contracted (SSE4.2 would be the older
  baseline, but without F16C XLA:CPU's bf16 conversions fail to link).

Each process runs the reference's defining tests (`tile.hadamard_rows`
against an independent NumPy model, zeros' signs included), the columns
kernels against the reference (interpreted, bit for bit) and the 1x16 and
16x16 quantizers against TE's NumPy model. With the former dot in the
reference the first configuration fails (measured: codes 8/128 against 0
in `test_rht_columns_words_path`).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

CONFIGS = {
    "AVX2, own dots": "--xla_cpu_max_isa=AVX2 "
                      "--xla_cpu_experimental_ynn_fusion_type=",
    "AVX": "--xla_cpu_max_isa=AVX",
}

CHECKS = (
    "tests/core/test_hadamard.py::test_rht_arithmetic_is_defined[16]",
    "tests/core/test_hadamard.py::test_rht_arithmetic_is_defined[64]",
    "tests/kernels/test_kernels.py::test_rht_columns_words_path",
    "tests/kernels/test_kernels.py::test_rht_columns_flushes_products_as_the_reference",
    "tests/core/test_nvfp4_numerics.py::test_bit_exact_many_tensors",
)


def test_numerics_under_other_cpu_code_generation():
  """The checks above pass in processes whose XLA:CPU compiles for each
  configuration (appended to the suite's `XLA_FLAGS`), run side by side:
  ~15 s of CPU each."""
  procs = {}
  for config, flags in CONFIGS.items():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p]))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    env.pop("PYTEST_XDIST_WORKER", None)
    procs[config] = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
         "no:cacheprovider", "-W", "ignore::RuntimeWarning", *CHECKS],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
  outs = {config: proc.communicate(timeout=300)[0]
          for config, proc in procs.items()}
  for config, out in outs.items():
    flags = CONFIGS[config]
    if procs[config].returncode and "Unknown flag" in out:
      pytest.skip(f"this jaxlib lacks a flag of {flags!r}: {out[-300:]}")
    assert procs[config].returncode == 0, f"{config} ({flags}):\n{out[-8000:]}"
    assert " passed" in out, out[-2000:]
