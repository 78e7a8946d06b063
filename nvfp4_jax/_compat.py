"""Deprecated paths: one table, and each use warns naming the new path.

The one-folder-per-op layout moved the library's modules; for one release
their old paths still work, each with a `DeprecationWarning` that says where
the thing lives now (optax's `deprecation_getattr` pattern):

  import nvfp4_jax.layers            # -> nvfp4_jax.flax.linen
  from nvfp4_jax.gemm import block_scaled_matmul
                                     # -> nvfp4_jax.ops.block_scaled_matmul.api
  nvfp4_jax.ops.dot_general          # -> nvfp4_jax.training.dot_general

`DEPRECATED` is the whole list. `install()` (the package's `__init__` calls
it) puts the finder for the old module paths on `sys.meta_path` and the
look-up of old names on the modules that held them; `module_getattr` is the
package's own `__getattr__` (`nv.layers`). The table names modules of every
layer, so this file sits above them all (tests/docs/test_layout.py reads its
strings as imports): a module below that needs a moved name imports its new
path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# Old path -> where it is now. Three kinds of entry:
#   "pkg.old": "pkg.new"          a module that moved whole: the old path is
#                                 the new module itself (so attribute writes
#                                 reach the code that reads them);
#   "pkg.old": ("pkg.a", ...)     a module that was split: each name is read
#                                 from the first of these modules that has it;
#   "pkg.mod:name": "pkg.new:name"  a name that left a module that stays.
DEPRECATED: dict[str, str | tuple[str, ...]] = {
    # Moved whole.
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
    "nvfp4_jax.parallel": "nvfp4_jax.sharding",
    "nvfp4_jax.parallel.mesh": "nvfp4_jax.sharding.mesh",
    "nvfp4_jax.parallel.hlo": "nvfp4_jax.sharding.hlo",
    "nvfp4_jax.sensitivity": "nvfp4_jax.tools.sensitivity",
    "nvfp4_jax.safetensors": "nvfp4_jax.tools.safetensors",
    "nvfp4_jax.export": "nvfp4_jax.tools.export",
    # Split.
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
    # `nvfp4_jax.ops` was the training op's module before it was the ops'
    # package.
    "nvfp4_jax.ops:dot_general": "nvfp4_jax.training.dot_general:dot_general",
    "nvfp4_jax.ops:remat_policy":
        "nvfp4_jax.training.names:remat_policy",
    "nvfp4_jax.ops:layer_scope": "nvfp4_jax.training.names:layer_scope",
    "nvfp4_jax.ops:LAYER_SCOPE": "nvfp4_jax.training.names:LAYER_SCOPE",
    "nvfp4_jax.ops:RESIDUAL_NAME":
        "nvfp4_jax.training.names:RESIDUAL_NAME",
    # The expert exchange's knobs, read and set (`_MovedNames`).
    "nvfp4_jax.flax.moe:EXCHANGE": "nvfp4_jax.training.moe:EXCHANGE",
    "nvfp4_jax.flax.moe:EXCHANGE_SLACK":
        "nvfp4_jax.training.moe:EXCHANGE_SLACK",
}

def _warn(old: str, new: str) -> None:
  """Warns that `old` is deprecated, at the user's line that used it."""
  # The first frame outside this file and the import system is the user's.
  # `warnings` itself steps over the import system's bootstrap frames, so
  # only the others count.
  frame, level = sys._getframe(1), 2  # pylint: disable=protected-access
  while frame is not None and (
      frame.f_code.co_filename == __file__
      or frame.f_globals.get("__name__", "").partition(".")[0] == "importlib"):
    if "_bootstrap" not in frame.f_code.co_filename:
      level += 1
    frame = frame.f_back
  warnings.warn(f"{old} is deprecated: it moved to {new}.",
                DeprecationWarning, stacklevel=level)


def _resolve(path: str):
  """The object at "module:name", or the module at "module"."""
  module, _, name = path.partition(":")
  module = importlib.import_module(module)
  return getattr(module, name) if name else module


def module_getattr(module: str):
  """`module`'s `__getattr__`, serving its deprecated names with a warning.

  Args:
    module: the module's name ("nvfp4_jax", "nvfp4_jax.ops").

  Returns:
    The function to set as the module's `__getattr__`: an old submodule
    (`nv.layers`) or an old name (`nvfp4_jax.ops.dot_general`) warns and is
    returned; anything else raises `AttributeError` as a module does.
  """
  def __getattr__(name: str):  # pylint: disable=invalid-name
    if f"{module}.{name}" in DEPRECATED:
      return importlib.import_module(f"{module}.{name}")  # The finder warns.
    new = DEPRECATED.get(f"{module}:{name}")
    if new is not None:
      _warn(f"{module}.{name}", new.replace(":", "."))
      return _resolve(new)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
  return __getattr__


class _MovedNames(types.ModuleType):
  """A module that stays, some of whose names moved: a write of a moved name
  (a knob such as `nvfp4_jax.flax.moe.EXCHANGE`) warns and sets it in its
  new home, where it is read, instead of setting a name nothing reads.
  Reads go through the module's `__getattr__` (`module_getattr`)."""

  def __setattr__(self, name: str, value) -> None:
    new = DEPRECATED.get(f"{self.__name__}:{name}")
    if new is None:
      super().__setattr__(name, value)
      return
    _warn(f"{self.__name__}.{name}", new.replace(":", "."))
    home, _, attr = new.partition(":")
    setattr(importlib.import_module(home), attr, value)


class _SplitModule(types.ModuleType):
  """A split module's old path: each name read warns and names its home."""

  def __init__(self, name: str, homes: tuple[str, ...]):
    super().__init__(name, f"Deprecated: see {', '.join(homes)}.")
    self._homes = homes

  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise AttributeError(attr)
    for home in self._homes:
      module = importlib.import_module(home)
      if hasattr(module, attr):
        _warn(f"{self.__name__}.{attr}", f"{home}.{attr}")
        return getattr(module, attr)
    raise AttributeError(
        f"module {self.__name__!r} has no attribute {attr!r} (its names "
        f"moved to {', '.join(self._homes)}).")

  def __dir__(self):
    names = set()
    for home in self._homes:
      names.update(dir(importlib.import_module(home)))
    return sorted(names)


class _Loader(importlib.abc.Loader):
  """Loads an old module path as its new module (or a `_SplitModule`)."""

  def __init__(self):
    self._spec = None

  def create_module(self, spec):
    new = DEPRECATED.get(spec.name)
    if isinstance(new, tuple):
      return _SplitModule(spec.name, new)
    if spec.name in DEPRECATED:
      _warn(spec.name, new)
    module = importlib.import_module(new)
    self._spec = module.__spec__
    return module

  def exec_module(self, module):
    # The import system set the alias's spec on the new module: give it back
    # its own (importlib.reload and find_spec read it).
    if self._spec is not None:
      module.__spec__ = self._spec


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path=None, target=None):
    if fullname in DEPRECATED:
      return importlib.util.spec_from_loader(fullname, _Loader())
    return None


def install() -> None:
  """Serves the old paths: the finder on `sys.meta_path` (once) and the
  look-up of old names on each module that stays (`nvfp4_jax.ops`)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
  for name in sorted({k.partition(":")[0] for k in DEPRECATED if ":" in k}):
    module = importlib.import_module(name)
    module.__getattr__ = module_getattr(name)
    module.__class__ = _MovedNames
