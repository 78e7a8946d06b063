"""Old module paths, kept importable after the one-folder-per-op layout.

`import nvfp4_jax.fused`, `from nvfp4_jax.gemm import block_scaled_matmul`,
`from pallas_kernels.quantize import quantize` and the like keep working: a
meta-path finder maps each old module name to its new home. A module that moved
whole is the new module itself (so attribute writes reach the code that reads
them); a module that was split is a read-only view over the modules that now
hold its names. New code imports the new paths (README's layout table).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

# Old module -> its new home (moved whole).
MOVED = {
    "nvfp4_jax.numerics": "nvfp4_jax.core.numerics",
    "nvfp4_jax.tile": "nvfp4_jax.core.tile",
    "nvfp4_jax.prng": "nvfp4_jax.core.prng",
    "nvfp4_jax.hadamard": "nvfp4_jax.core.hadamard",
    "nvfp4_jax.qarray": "nvfp4_jax.core.arrays",
    "nvfp4_jax.dispatch": "nvfp4_jax.core.dispatch",
    "nvfp4_jax.spmd": "nvfp4_jax.core.spmd",
    "nvfp4_jax.recipe": "nvfp4_jax.core.recipe",
    "nvfp4_jax.optim": "nvfp4_jax.training.master_weights",
    "nvfp4_jax.layers": "nvfp4_jax.flax.linen",
    "nvfp4_jax.nnx_layers": "nvfp4_jax.flax.nnx",
    "nvfp4_jax.interop": "nvfp4_jax.flax.inject",
    "nvfp4_jax.rules": "nvfp4_jax.flax.rules",
    "nvfp4_jax.hlo": "nvfp4_jax.sharding.hlo",
    "nvfp4_jax.report": "nvfp4_jax.tools.report",
    "nvfp4_jax.sensitivity": "nvfp4_jax.tools.sensitivity",
    "nvfp4_jax.safetensors": "nvfp4_jax.tools.safetensors",
    "nvfp4_jax.export": "nvfp4_jax.tools.export",
    "pallas_kernels.quantize": "nvfp4_jax.ops.quantize.pallas_triton",
    "pallas_kernels.quantize_rht_t": "nvfp4_jax.ops.quantize_rht_t.pallas_triton",
    "pallas_kernels.quantize_pair": "nvfp4_jax.ops.quantize_pair.pallas_triton",
    "pallas_kernels.block_dequantize": "nvfp4_jax.ops.block_values.pallas_triton",
    "pallas_kernels.values_matmul":
        "nvfp4_jax.ops.block_scaled_matmul.pallas_mosaic_gpu",
    "pallas_kernels.block_scaled_matmul": "nvfp4_jax.ops.block_scaled_matmul.triton",
    "pallas_kernels.weight_only_matmul":
        "nvfp4_jax.ops.weight_only_matmul.pallas_triton",
}

# Old module -> the modules that now hold its names (split).
SPLIT = {
    "nvfp4_jax.nvfp4": ("nvfp4_jax.ops.quantize.api",
                        "nvfp4_jax.ops.quantize.reference",
                        "nvfp4_jax.ops.block_values.reference",
                        "nvfp4_jax.core.arrays"),
    "nvfp4_jax.fused": ("nvfp4_jax.ops.quantize.api",
                        "nvfp4_jax.ops.quantize_rht_t.api",
                        "nvfp4_jax.ops.quantize_rht_t.reference",
                        "nvfp4_jax.ops.quantize_pair.api",
                        "nvfp4_jax.ops.quantize_pair.reference"),
    "nvfp4_jax.gemm": ("nvfp4_jax.ops.block_scaled_matmul.api",
                       "nvfp4_jax.ops.block_scaled_matmul.reference",
                       "nvfp4_jax.ops.block_scaled_matmul.cudnn",
                       "nvfp4_jax.ops.block_values.api",
                       "nvfp4_jax.ops.weight_only_matmul.api",
                       "nvfp4_jax.ops.weight_only_matmul.reference"),
    "nvfp4_jax.mx": ("nvfp4_jax.core.arrays", "nvfp4_jax.ops.quantize.mx",
                     "nvfp4_jax.ops.block_values.reference"),
    "nvfp4_jax.quant": ("nvfp4_jax.ops.block_values.api",
                        "nvfp4_jax.core.arrays"),
}


class _SplitModule(types.ModuleType):
  """A split module's old name: reads each name from its new home."""

  def __init__(self, name: str, homes: tuple[str, ...]):
    super().__init__(name, f"Moved: see {', '.join(homes)}.")
    self._homes = homes

  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise AttributeError(attr)
    for home in self._homes:
      module = importlib.import_module(home)
      if hasattr(module, attr):
        return getattr(module, attr)
    raise AttributeError(
        f"module {self.__name__!r} has no attribute {attr!r} (it moved to "
        f"{', '.join(self._homes)}).")

  def __dir__(self):
    names = set()
    for home in self._homes:
      names.update(dir(importlib.import_module(home)))
    return sorted(names)


class _Loader(importlib.abc.Loader):

  def create_module(self, spec):
    if spec.name in MOVED:
      return importlib.import_module(MOVED[spec.name])
    return _SplitModule(spec.name, SPLIT[spec.name])

  def exec_module(self, module):
    pass


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path=None, target=None):
    if fullname in MOVED or fullname in SPLIT:
      return importlib.util.spec_from_loader(fullname, _Loader())
    return None


def install() -> None:
  """Puts the finder on `sys.meta_path` once."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
