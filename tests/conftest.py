"""Shared test configuration: hypothesis profile and heavy-tailed test data.

The tests live in one folder per package (`tests/core`, `tests/ops`, ...);
their helpers live in `tests/support` (e.g. `te_reference.py`, an
independent NumPy model of TransformerEngine's arithmetic, and the vendored
third-party models): this file puts that folder on `sys.path`, so tests
import the helpers as top-level modules (`import te_reference`). It is
also importable itself as `conftest` (pytest puts this directory on
`sys.path`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))

# README runs the suite on a GPU with several processes (`pytest -n 4`). By
# default JAX preallocates 75% of the GPU's memory in each process, so the
# first worker would take it and the others fail to allocate (measured on an
# H100: 14 of 39 kernel and layer tests failed). Each test process allocates
# what it uses instead; a value set by the user is kept. Set before JAX
# starts a backend: the workers and the processes tests start inherit it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# On a machine of several GPUs, `NVFP4_TEST_GPUS=4 pytest -n 16 ...` gives
# each xdist worker one GPU (worker i sees GPU i mod 4), so the workers do
# not all share GPU 0; the tests that need two GPUs then skip (run them
# in a process of their own). Set before JAX starts a backend.
_gpus = os.environ.get("NVFP4_TEST_GPUS")
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus and _worker.startswith("gw"):
  os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(_gpus))


def _cuda_plugin_installed() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return any(importlib.util.find_spec(m) is not None
             for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


# Where JAX can only run on the CPU, the suite's time is mostly XLA:CPU
# compiling small programs: LLVM's optimizations off make it about a quarter
# faster (measured on 2 cores) and change no result (they transform IR, not
# the floating-point operations XLA emits: every bit-exactness test passes
# either way). GPU and ahead-of-time GPU compiles keep XLA's defaults. The
# worker and the mesh tests' processes inherit the flag.
if not _cuda_plugin_installed():
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import gc  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

# Tracing and lowering allocate many short-lived Python objects, and with
# the default thresholds (700, 10, 10) the cyclic collector ran often enough
# to be ~5% of a compile-heavy test's CPU profile, walking the long-lived
# objects of jax, flax and the test modules each time. The objects imported
# so far are frozen out of its walks and it runs ~70x less often: 9% less
# time on a compile-heavy sample of the suite (remat, numerics, block values,
# rules: 66-68 s -> 60-62 s, two runs each). Only when the collector runs
# changes, never what a test computes.
gc.freeze()
gc.set_threshold(50_000, 20, 100)

try:
  import hypothesis
except ImportError:  # e.g. on the GPU machine; test_properties skips itself.
  hypothesis = None

if hypothesis is not None:
  # Derandomized so CI is reproducible; HYPOTHESIS_PROFILE=thorough digs deeper.
  _SUPPRESS = [hypothesis.HealthCheck.too_slow,
               hypothesis.HealthCheck.data_too_large]
  hypothesis.settings.register_profile(
      "ci", max_examples=30, deadline=None, derandomize=True,
      suppress_health_check=_SUPPRESS)
  hypothesis.settings.register_profile(
      "thorough", max_examples=1000, deadline=None,
      suppress_health_check=_SUPPRESS)
  hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
  """One persistent JAX compilation cache for the whole session.

  Most of the suite's time is XLA compilation, and many tests compile the
  same programs (every `Trainer` of one model compiles the same
  `init_state`; a resumed run or a CLI subprocess recompiles its trainer's
  step): with the cache each distinct program compiles once. The cache is
  a fresh temporary directory, shared through the environment by the xdist
  workers and by the processes the tests start (CLI runs, mesh checks,
  notebook kernels), and removed at the end; a program is only ever
  replaced by the executable XLA built for the same program and options.
  A `JAX_COMPILATION_CACHE_DIR` already set is used as it is;
  `NVFP4_TEST_COMPILATION_CACHE=0` turns the cache off.
  """
  if (hasattr(config, "workerinput")  # An xdist worker: set by the parent.
      or os.environ.get("JAX_COMPILATION_CACHE_DIR")
      or os.environ.get("NVFP4_TEST_COMPILATION_CACHE") == "0"):
    return
  path = tempfile.mkdtemp(prefix="nvfp4-jax-compilation-cache-")
  config.stash[_CACHE_DIR] = path
  # Every program, however quick to compile: the small ones add up too.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# Under `-n` (README's command), the suite runs as `--dist loadfile
# --no-loadscope-reorder` unless `--dist` says otherwise
# (`pytest_cmdline_main` below): each test file runs whole on one xdist
# worker, so what a file's
# tests share (module fixtures, `functools.cache`d traces, compiled programs,
# the mesh-checks process) is computed once, not once per worker that draws
# one of its tests: 1,149 -> 926 s of CPU for the same suite on 2 cores.
# Files go to the workers in collection order (`--no-loadscope-reorder`),
# and this puts the longest first (seconds of one file on 2 cores, measured
# 2026-12-04): under `-n 2` the last files to run are then short ones, and
# neither worker waits alone at the end on a long one. Only the order
# changes, never what a test computes.
_LONGEST_FIRST = (
    "tests/sharding/test_mesh.py",             # ~100 s: the mesh process.
    "tests/kernels/test_kernels.py",           # ~84 s.
    "tests/ops/test_pair_and_dispatch.py",     # ~42 s.
    "tests/flax/test_third_party.py",          # ~35 s.
    "tests/ops/test_block_values.py",          # ~34 s.
    "tests/train/test_preemption.py",          # ~30 s: CLI processes.
    "tests/train/test_train.py",               # ~32 s.
    "tests/models/test_hf_export.py",          # ~29 s.
    "tests/models/test_models.py",             # ~29 s.
    "tests/train/test_run_safety.py",          # ~25 s.
)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """`-n N` alone means `--dist loadfile --no-loadscope-reorder` here (set
  before pytest-xdist reads them; a run without xdist is unaffected)."""
  if (config.pluginmanager.hasplugin("xdist")
      and config.getoption("numprocesses", None)
      and config.getoption("dist", "no") == "no"):
    config.option.dist = "loadfile"
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0],
                                       len(rank)))


@pytest.fixture(scope="session")
def mesh_fast_checks():
  """`(stdout, stderr)` of the fast tier's mesh checks, run in one process
  for the session (`tests/support/mesh_run.py`). Only
  `tests/sharding/test_mesh.py` reads it: under `--dist loadfile` one
  worker runs that file, so the process runs once."""
  import mesh_run  # pylint: disable=g-import-not-at-top
  return mesh_run.run_fast()


def pytest_unconfigure(config):
  path = config.stash.get(_CACHE_DIR, None)
  if path is not None:
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _default_implementation():
  """NVFP4_TEST_IMPLEMENTATION=xla|pallas|... runs the whole suite with that
  implementation as the default of every op (`nvfp4_jax.core.dispatch`), so the
  same tests check the reference and each kernel (e.g. on the GPU machine)."""
  name = os.environ.get("NVFP4_TEST_IMPLEMENTATION")
  if not name:
    yield
    return
  from nvfp4_jax.core import dispatch  # pylint: disable=g-import-not-at-top
  with dispatch.default_implementation(name):
    yield

NP_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}
JNP_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def make_heavy_tailed(shape, dtype="float32", seed=0, *, sigma=1.5,
                      outlier_frac=0.003, peak=1000.0) -> np.ndarray:
  """Gaussian values times lognormal row and column scales, plus outliers.

  This is the input that exercises the scale logic: block amaxes spread over
  many binades (so the E4M3 scales take many values, a few blocks underflow),
  and a few outliers 5-50x larger than everything else set the tensor amax.
  With uniform inputs nearly every block scale would saturate at 448 and tile
  indexing bugs would go unseen (NVFP4_SPEC section 3).

  Args:
    shape: at least 2-D; the last two axes get the row/column scales.
    dtype: "float32", "bfloat16" or "float16" (values fit float16's range).
    seed: numpy seed.
    sigma: log-std of the row and column scales.
    outlier_frac: fraction of elements turned into outliers.
    peak: the largest non-outlier magnitude.

  Returns:
    numpy array of `dtype` (ml_dtypes.bfloat16 for bfloat16).
  """
  rng = np.random.default_rng(seed)
  *lead, m, k = shape
  x = rng.standard_normal(shape)
  x *= np.exp(sigma * rng.standard_normal((*lead, m, 1)))
  x *= np.exp(sigma * rng.standard_normal((*lead, 1, k)))
  x *= peak / np.max(np.abs(x))
  n_out = max(1, int(outlier_frac * x.size))
  idx = rng.choice(x.size, n_out, replace=False)
  flat = x.reshape(-1)
  flat[idx] = rng.choice([-1.0, 1.0], n_out) * rng.uniform(5, 50, n_out) * peak
  return x.astype(NP_DTYPES[dtype])


@pytest.fixture
def heavy_tailed():
  return make_heavy_tailed


def assert_scales_diverse(scales) -> None:
  """Guards the guards: the data must produce many distinct block scales."""
  b = np.asarray(scales).view(np.uint8).reshape(-1)
  frac_max = np.mean(b == 0x7E)  # 448 in E4M3
  assert frac_max < 0.25, f"{frac_max:.0%} of scales saturate at 448"
  assert np.unique(b).size >= min(12, b.size // 4), np.unique(b).size


@pytest.fixture
def claim_sm90(monkeypatch):
  """Off-GPU, makes the kernels lower for CUDA as on an sm_90 GPU (nothing
  runs): `jax.jit(fn).trace(...).lower(lowering_platforms=("cuda",))`."""
  from pallas_kernels import launch  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(launch, "backend", lambda: "gpu")
  monkeypatch.setattr(launch, "compute_capability", lambda: (9, 0))
  if hasattr(reg, "gpu_info_lib"):  # jax >= 0.11 asks the (absent) GPU.
    monkeypatch.setattr(reg, "gpu_info_lib", types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90)))
