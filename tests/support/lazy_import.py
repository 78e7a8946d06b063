"""Modules imported when a test first uses them, not when pytest collects.

torch, transformers and compressed-tensors take ~7 s of CPU to import. At
module level in a test file, every pytest-xdist worker paid that while
collecting, whichever worker then ran the tests. `lazy("torch")` stands for
the module and imports it on its first attribute access; `skip_unless(...)`
skips a module whose extra is not installed without importing it.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest


class lazy:  # pylint: disable=invalid-name
  """`lazy("a.b").name` is `importlib.import_module("a.b").name`."""

  def __init__(self, module: str):
    self._module = module

  def __getattr__(self, name: str):
    # Private and special names are pytest's probes while it collects a
    # module's globals (`__test__`, `_fixture_function_marker`, ...), not a
    # test's use: answering them would import the module at collection.
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(importlib.import_module(self._module), name)

  def __repr__(self) -> str:
    return f"lazy({self._module!r})"


def skip_unless(*modules: str, reason: str) -> pytest.MarkDecorator:
  """A `pytestmark` that skips where one of `modules` cannot be found."""
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  return pytest.mark.skipif(bool(missing),
                            reason=f"{reason} (missing: {', '.join(missing)})")
