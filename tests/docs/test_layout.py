"""The package's layout: one folder per op, layered one way, no import cycle.

Layers, bottom up (README, "Layout"): `nvfp4_jax.core` and `pallas_kernels`
(the shared numerics and Pallas plumbing) < `nvfp4_jax.ops` (one folder per
op) < `nvfp4_jax.sharding` < `nvfp4_jax.training` < `nvfp4_jax.flax` <
`nvfp4_jax.tools` < the package's `__init__` and its table of deprecated
paths (`_compat`). A module imports only from its own layer or below, by an
import statement or by a string (`importlib.import_module("...")`, a
dispatch table's "module:function"): a string import is an edge like any
other. The kernels take primitive arguments (no `Recipe`).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("nvfp4_jax", "pallas_kernels")
LAYERS = (("nvfp4_jax.core", 0), ("pallas_kernels", 0), ("nvfp4_jax.ops", 1),
          ("nvfp4_jax.sharding", 2), ("nvfp4_jax.training", 3),
          ("nvfp4_jax.flax", 4), ("nvfp4_jax.tools", 5))
# The package's entry points and the table of deprecated paths (`_compat`,
# which serves old module paths from their new homes) sit above everything.
TOP = 6
# A string that names a project module ("nvfp4_jax.ops.quantize.api"), or a
# name in one ("module:function"), as import_module, find_spec, a dispatch
# table or an alias table take it.
MODULE_STRING = re.compile(
    r"((?:nvfp4_jax|pallas_kernels)(?:\.\w+)*)(?::\w+)?")
# The only modules that import a module named at run time (a computed
# string, which no check can read): the dispatch, which imports the
# "module:function" strings of the ops' tables (read where they are
# written), and the top.
DYNAMIC_IMPORTERS = ("nvfp4_jax.core.dispatch",)
KERNEL_FILES = ("pallas_triton", "pallas_mosaic_gpu", "triton")
OP_FILES = {"__init__", "api", "reference", "config", "sharded", "mx",
            "cudnn", *KERNEL_FILES}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
  for prefix, level in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      return level
  return TOP


def imports(path: pathlib.Path, source: str | None = None) -> set[str]:
  """The project modules `path` imports, anywhere in it (lazy ones too, and
  those named by a string); `source` stands in for the file's text."""
  tree = ast.parse(path.read_text() if source is None else source)
  out = set()
  package = module_name(path) if path.name == "__init__.py" else (
      module_name(path).rpartition(".")[0])
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      if m := MODULE_STRING.fullmatch(node.value):
        out.add(m.group(1))
      continue
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) + 1
                                               - node.level] + [base])
      # `from pkg import mod` imports the module `pkg.mod` where one exists.
      names = [f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base
               for a in node.names]
    else:
      continue
    out.update(n for n in names if n.split(".")[0] in PACKAGES)
  return out


def _exists(module: str) -> bool:
  path = ROOT.joinpath(*module.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def dynamic_imports(path: pathlib.Path, source: str | None = None) -> list[str]:
  """The calls in `path` that import a module whose name is not a literal."""
  tree = ast.parse(path.read_text() if source is None else source)
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call) or not node.args:
      continue
    func = ast.unparse(node.func)
    if (func.split(".")[-1] in ("import_module", "__import__", "find_spec")
        and not isinstance(node.args[0], ast.Constant)):
      out.append(f"{module_name(path)}:{node.lineno}: {ast.unparse(node)}")
  return out


def graph() -> dict[str, set[str]]:
  return {module_name(p): imports(p) for pkg in PACKAGES
          for p in sorted((ROOT / pkg).rglob("*.py"))}


def upward(g: dict[str, set[str]]) -> list[str]:
  return sorted(f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
                for m, deps in g.items() for d in deps if layer(d) > layer(m))


def cycle(g: dict[str, set[str]]) -> list[str] | None:
  """One import cycle among the modules of `g`, or None."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(g.get(m, ())):
      if d not in g:
        continue
      if state.get(d) == 1:
        return stack[stack.index(d):] + [d]
      if d not in state and (found := visit(d)):
        return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(g):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_nothing_below_imports_upward():
  assert upward(graph()) == []


def test_no_import_by_a_computed_name():
  """A module named at run time is an edge no check can see."""
  found = [call for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
           if module_name(p) not in DYNAMIC_IMPORTERS
           and layer(module_name(p)) < TOP for call in dynamic_imports(p)]
  assert found == []


def test_no_import_cycle():
  # Package __init__ files re-export their children (an edge parent ->
  # child); a child importing a sibling through the parent is no cycle.
  g = {m: {d for d in deps if not m.startswith(d + ".")}
       for m, deps in graph().items()}
  assert cycle(g) is None


def test_the_checks_catch_what_they_forbid():
  g = {"nvfp4_jax.core.tile": {"nvfp4_jax.ops.quantize.api"},
       "nvfp4_jax.ops.quantize.api": {"nvfp4_jax.core.tile"}}
  assert upward(g) == ["nvfp4_jax.core.tile (layer 0) imports "
                       "nvfp4_jax.ops.quantize.api (layer 1)"]
  assert cycle(g) == ["nvfp4_jax.core.tile", "nvfp4_jax.ops.quantize.api",
                      "nvfp4_jax.core.tile"]
  # The real tree has such edges in neither direction of these modules.
  real = graph()
  assert "nvfp4_jax.ops.quantize.api" not in real["nvfp4_jax.core.tile"]
  # An import through a string is read like an import statement: a call,
  # a dispatch table's "module:function", an entry of an alias table.
  tile = ROOT / "nvfp4_jax" / "core" / "tile.py"
  for planted in ('importlib.import_module("nvfp4_jax.training.dot_general")',
                  '__import__("nvfp4_jax.flax.linen")',
                  'importlib.util.find_spec("nvfp4_jax.tools.report")',
                  'OP = {"pallas": "nvfp4_jax.training.ragged_dot:ragged_dot"}',
                  'OLD = {"nvfp4_jax.old": "nvfp4_jax.parallel.mesh"}'):
    deps = imports(tile, tile.read_text() + "\n" + planted + "\n")
    assert upward({"nvfp4_jax.core.tile": deps}), planted
  # A deprecated path is served from the top: naming one below is upward.
  deps = imports(tile, 'importlib.import_module("nvfp4_jax.numerics")\n')
  assert upward({"nvfp4_jax.core.tile": deps}) == [
      "nvfp4_jax.core.tile (layer 0) imports nvfp4_jax.numerics (layer 6)"]
  assert dynamic_imports(tile, 'importlib.import_module(f"nvfp4_jax.{x}")\n')


def test_kernels_take_primitive_arguments():
  """A kernel file imports the shared numerics, the Pallas plumbing and other
  ops' kernels or configs: not the recipe, and no op's API."""
  for path in (ROOT / "nvfp4_jax" / "ops").rglob("*.py"):
    if path.stem not in KERNEL_FILES:
      continue
    for dep in imports(path):
      assert dep != "nvfp4_jax.core.recipe", (path, dep)
      assert layer(dep) == 0 or re.fullmatch(
          r"nvfp4_jax\.ops\.\w+\."
          r"(config|pallas_triton|pallas_mosaic_gpu|triton)", dep), (path, dep)


def test_one_folder_per_op():
  ops = ROOT / "nvfp4_jax" / "ops"
  folders = sorted(p.name for p in ops.iterdir() if p.is_dir()
                   and p.name != "__pycache__")
  assert folders == ["block_scaled_matmul", "block_values", "gather_rows",
                     "quantize",
                     "quantize_pair", "quantize_rht_t", "ragged_dot",
                     "ragged_quantize", "weight_only_matmul"]
  for name in folders:
    files = {p.stem for p in (ops / name).glob("*.py")}
    assert {"__init__", "api", "reference"} <= files, name
    assert files <= OP_FILES, (name, files - OP_FILES)
  # Every op with a kernel has its tile config beside it.
  for name in folders:
    files = {p.stem for p in (ops / name).glob("*.py")}
    if files & set(KERNEL_FILES) and name != "block_values":
      assert "config" in files, name


def test_readme_layout_table_is_true():
  text = (ROOT / "docs" / "layout.md").read_text()
  table = text[text.index("# Package layout"):]
  paths = re.findall(r"`((?:nvfp4_jax|pallas_kernels|models|train|tests|"
                     r"benchmarks|notebooks|docs)/[^`]*)`", table)
  assert len(paths) >= 10
  for p in paths:
    for alt in re.sub(r"\{([^}]*)\}", lambda m: m.group(1).split(",")[0],
                      p).split(" "):
      assert (ROOT / alt.rstrip("/")).exists(), p


@pytest.mark.parametrize("old, name", [
    ("nvfp4_jax.fused", "quantize_pair"),
    ("nvfp4_jax.gemm", "block_scaled_matmul"),
    ("nvfp4_jax.nvfp4", "quantize"),
    ("nvfp4_jax.quant", "dequantize"),
    ("nvfp4_jax.mx", "quantize_mx"),
    ("nvfp4_jax.ops", "dot_general"),
    ("nvfp4_jax.layers", "NVFP4Dense"),
    ("nvfp4_jax.sharding", "MeshRules"),
    ("nvfp4_jax.recipe", "Recipe"),
])
def test_old_module_paths_keep_importing(old, name):
  """Names that moved stay importable from where users found them."""
  module = importlib.import_module(old)
  assert callable(getattr(module, name))


def _deprecated():
  from nvfp4_jax import _compat  # pylint: disable=g-import-not-at-top
  return _compat.DEPRECATED


@pytest.mark.parametrize("old", sorted(_deprecated()))
def test_each_deprecated_path_warns_naming_its_new_path(old, monkeypatch):
  new = _deprecated()[old]
  if ":" in old:  # A name that left a module that stays.
    (module, name), (home, new_name) = old.split(":"), new.split(":")
    with pytest.warns(DeprecationWarning,
                      match=re.escape(f"to {home}.{new_name}.") + "$"):
      got = getattr(importlib.import_module(module), name)
    assert got is getattr(importlib.import_module(home), new_name)
  elif isinstance(new, str):  # A module that moved whole: warns on import.
    parent, _, leaf = old.rpartition(".")
    if leaf in vars(sys.modules[parent]):  # (hasattr would import it.)
      monkeypatch.delattr(sys.modules[parent], leaf)
    monkeypatch.delitem(sys.modules, old, raising=False)
    message = f"{old} is deprecated: it moved to {new}."
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
      got = importlib.import_module(old)
    assert got is importlib.import_module(new)
    assert got.__spec__.name == new  # The new module keeps its own spec.
  else:  # A split module: each name read warns, naming its home.
    module = importlib.import_module(old)
    homes = [importlib.import_module(h) for h in new]
    for name in [n for n in dir(module) if not n.startswith("_")]:
      home = next(h for h in homes if hasattr(h, name))
      with pytest.warns(DeprecationWarning,
                        match=re.escape(f"to {home.__name__}.{name}.") + "$"):
        got = getattr(module, name)
      assert got is getattr(home, name)


def test_a_moved_knob_set_at_its_old_path_reaches_its_new_home(monkeypatch):
  """`nvfp4_jax.flax.moe.EXCHANGE = ...` (the knob before it moved) warns
  and sets the one the exchange reads, `nvfp4_jax.training.moe.EXCHANGE`."""
  from nvfp4_jax.flax import moe  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.training import moe as training_moe  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(training_moe, "EXCHANGE", training_moe.EXCHANGE)
  with pytest.warns(DeprecationWarning,
                    match=re.escape("to nvfp4_jax.training.moe.EXCHANGE.")):
    moe.EXCHANGE = "ragged"
  assert training_moe.EXCHANGE == "ragged"
  assert "EXCHANGE" not in vars(moe)


def test_current_names_do_not_warn():
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    # pylint: disable=g-import-not-at-top
    from nvfp4_jax import export
    from nvfp4_jax.tools import sensitivity
    assert export is nv.export and sensitivity.analyze
    assert callable(nv.report) and callable(nv.dot_general)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
      nv.ops.nothing  # pylint: disable=pointless-statement
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module("nvfp4_jax.nothing")
