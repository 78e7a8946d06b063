"""The documentation: the Sphinx site builds without a warning, the API
reference lists the public API, every public name has a Google-style
docstring, and the pages' Python examples parse (the ones that run are run by
the tests named in `RUN_BY`)."""

import ast
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The pages' examples that a test runs as written: a string that only that
# block holds, its page, and the test that runs it. Every other Python block
# is illustrative (it names a model, batches or checkpoints it does not
# build) and is only parsed.
RUN_BY = {
    "nv.NVFP4Dense(512)": (("README.md", "docs/layers.md"),
                           "tests/docs/test_readme.py"),
    "inject_linen(": (("README.md", "docs/layers.md"),
                      "tests/flax/test_third_party.py"),
    "inject_nnx(": (("docs/layers.md",), "tests/flax/test_third_party.py"),
    "AxisType.Explicit": (("docs/sharding.md",),
                          "tests/sharding/test_mesh.py (mesh_checks)"),
    "nv.quantize_mx(x": (("docs/numerics.md",), "tests/docs/test_readme.py"),
}
# The lab journal is a record, not a page of examples.
PAGES = [ROOT / "README.md"] + sorted(
    p for p in DOCS.glob("*.md") if p.name != "journal.md")


def python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_python_blocks_parse_and_the_run_ones_are_where_their_tests_look():
  found = {marker: set() for marker in RUN_BY}
  for page in PAGES:
    for block in python_blocks(page):
      ast.parse(block, filename=str(page))
      for marker in RUN_BY:
        if marker in block:
          found[marker].add(str(page.relative_to(ROOT)))
  for marker, (pages, _) in RUN_BY.items():
    assert found[marker] == set(pages), (marker, found[marker])


def test_api_reference_lists_every_public_name():
  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  text = (DOCS / "api.md").read_text()
  # The groups' tables, in `__all__`'s order (the modules' members follow
  # under `.. currentmodule:: nvfp4_jax.<module>`).
  tables = re.findall(r"\.\. currentmodule:: nvfp4_jax\n\n\.\. autosummary::\n\n"
                      r"((?:   \w+\n)+)", text)
  listed = [n for table in tables for n in table.split()]
  assert listed == list(nvfp4_jax.__all__)
  for name in nvfp4_jax.__all__:
    assert re.search(rf"^\.\. (autoclass|autofunction|py:data):: {name}$",
                     text, re.M) or f"### `nvfp4_jax.{name}`" in text, name


# Public names whose docstrings still lack a section the test below asks
# for. It may only shrink: a name documented since must leave it, and a new
# name must come documented.
KNOWN_INCOMPLETE: frozenset[str] = frozenset()


def _public_objects():
  """`(name, object)` of `nvfp4_jax.__all__` and of the modules' members
  the API reference lists (`nvfp4_jax.export.save`, ...)."""
  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  out = [(n, getattr(nvfp4_jax, n)) for n in nvfp4_jax.__all__]
  text = (DOCS / "api.md").read_text()
  for module, member in re.findall(
      r"^\.\. auto(?:class|function):: nvfp4_jax\.(\w+)\.(\w+)$", text,
      re.M):
    out.append((f"{module}.{member}",
                getattr(getattr(nvfp4_jax, module), member)))
  return out


def test_api_reference_lists_every_name_of_the_sharding_package():
  """`nvfp4_jax.sharding.__all__`: each name in the reference, under the
  package or (the same object) at the top."""
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  text = (DOCS / "api.md").read_text()
  listed = set(re.findall(r"^\.\. (?:auto(?:class|function)|py:data):: "
                          r"nvfp4_jax\.sharding\.(\w+)", text, re.M))
  missing = [m for m in nv.sharding.__all__ if m not in listed and not (
      m in nv.__all__ and getattr(nv, m) is getattr(nv.sharding, m))]
  assert not missing, f"not in docs/api.md (run docs/gen_api.py): {missing}"
  assert all(hasattr(nv.sharding, m) for m in nv.sharding.__all__)


def _gives_a_value(fn) -> tuple[bool, bool]:
  """Whether `fn`'s own body returns a value, and whether it yields one."""
  fn = inspect.unwrap(fn)
  try:
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
  except (OSError, TypeError, SyntaxError):
    return False, False
  node = tree.body[0]
  if not isinstance(node, ast.FunctionDef):
    return False, False
  if isinstance(node.returns, ast.Constant) and node.returns.value is None:
    return False, False
  returns = yields = False
  todo = list(ast.iter_child_nodes(node))
  while todo:
    n = todo.pop()
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                      ast.ClassDef)):
      continue  # A nested definition's returns are its own.
    returns |= isinstance(n, ast.Return) and n.value is not None
    yields |= isinstance(n, (ast.Yield, ast.YieldFrom)) and n.value is not None
    todo.extend(ast.iter_child_nodes(n))
  return returns, yields


def _missing_sections(obj) -> list[str]:
  """What `obj`'s docstring lacks: its docstring, `Args:` (a class's
  `Attributes:` stands for it), `Returns:` / `Yields:`."""
  if isinstance(obj, types.ModuleType):
    return [] if obj.__doc__ else ["docstring"]
  if not callable(obj):
    return []  # Constants: api.md describes them (docs/gen_api.py's DATA).
  doc = inspect.getdoc(obj) if obj.__doc__ else None
  if not doc:
    return ["docstring"]
  missing = []
  try:
    params = [p for p in inspect.signature(obj).parameters
              if p not in ("self", "cls")]
  except (TypeError, ValueError):
    params = []
  if params and "Args:" not in doc and not (
      inspect.isclass(obj) and "Attributes:" in doc):
    missing.append("Args:")
  if inspect.isfunction(obj):
    returns, yields = _gives_a_value(obj)
    if returns and "Returns:" not in doc:
      missing.append("Returns:")
    if yields and "Yields:" not in doc and "Returns:" not in doc:
      missing.append("Yields:")
  return missing


def test_every_public_name_is_documented():
  missing = {name: _missing_sections(obj) for name, obj in _public_objects()}
  missing = {name: what for name, what in missing.items() if what}
  new = {name: what for name, what in missing.items()
         if name not in KNOWN_INCOMPLETE}
  assert not new, f"public names lacking docstring sections: {new}"
  done = KNOWN_INCOMPLETE - set(missing)
  assert not done, f"documented now, remove from KNOWN_INCOMPLETE: {done}"


def _fields(cls) -> set[str]:
  """A class's declared fields (dataclass, flax module), which document
  themselves in its `Attributes:`; their defaults may be functions."""
  names = set(getattr(cls, "__dataclass_fields__", {}))
  return names | set(getattr(cls, "__annotations__", {}))


def test_every_public_method_and_property_has_a_docstring():
  """The classes' own public methods and properties (what autodoc lists
  under each class), not only the classes."""
  missing = []
  for name, obj in _public_objects():
    if not inspect.isclass(obj):
      continue
    for member, value in list(vars(obj).items()):
      if member.startswith("_") or member in _fields(obj):
        continue
      fn = value.fget if isinstance(value, property) else getattr(
          value, "__func__", value)
      if not (isinstance(value, property) or inspect.isfunction(fn)):
        continue
      doc = value.__doc__ if isinstance(value, property) else fn.__doc__
      if not (doc or "").strip():
        missing.append(f"{name}.{member}")
  assert not missing, f"methods and properties without a docstring: {missing}"


def test_pages_are_in_the_toctree():
  index = (DOCS / "index.md").read_text()
  listed = set(re.findall(r"^(\w+)$", index, re.M))
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert pages <= listed, pages - listed


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None
    or importlib.util.find_spec("myst_parser") is None
    or importlib.util.find_spec("myst_nb") is None,
    reason="sphinx, myst-parser and myst-nb are not installed (pip install "
    "-e '.[docs]')")
def test_site_builds_without_warnings(tmp_path):
  # Offline: intersphinx is configured only with NVFP4_DOCS_INTERSPHINX=1,
  # so every warning left is the pages' or the docstrings' own.
  env = {k: v for k, v in os.environ.items()
         if k != "NVFP4_DOCS_INTERSPHINX"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going",
       "-q", "-d", str(tmp_path / "doctrees"), str(DOCS),
       str(tmp_path / "html")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-6000:]
  html = (tmp_path / "html" / "api.html").read_text()
  assert "nvfp4_jax.NVFP4Dense" in html and "nvfp4_jax.master_weights" in html
  # The notebooks rendered (myst-nb), each with its code cells.
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    page = (tmp_path / "html" / "notebooks" / f"{nb.stem}.html").read_text()
    assert "NVFP4Dense" in page or "nvfp4_jax" in page, nb.name
    assert page.count('class="cell docutils container"') >= 5, nb.name


SUBPACKAGES = ("core", "ops", "training", "flax", "tools")


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_every_subpackage_lists_its_modules_and_the_reference_names_them(sub):
  """Each subpackage's `__all__` is exactly its public modules (every
  `*.py` and op folder not starting with `_`), each with a module
  docstring, and the API reference's "Subpackages" section names them in
  that order (docs/gen_api.py writes it)."""
  import importlib  # pylint: disable=g-import-not-at-top
  pkg = importlib.import_module(f"nvfp4_jax.{sub}")
  folder = ROOT / "nvfp4_jax" / sub
  modules = sorted([p.stem for p in folder.glob("*.py")
                    if not p.stem.startswith("_")]
                   + [p.name for p in folder.iterdir() if p.is_dir()
                      and (p / "__init__.py").is_file()
                      and not p.name.startswith("_")])
  assert sorted(pkg.__all__) == modules, (sub, pkg.__all__)
  text = (DOCS / "api.md").read_text()
  # This subpackage's part of the section: up to the next heading.
  section = text[text.index(f"### `nvfp4_jax.{sub}`"):]
  section = section.split("\n#", 1)[0]
  listed = re.findall(rf"^\| `nvfp4_jax\.{sub}\.(\w+)` \| \S", section, re.M)
  assert listed == list(pkg.__all__), (sub, listed)
  for m in pkg.__all__:
    assert (importlib.import_module(f"nvfp4_jax.{sub}.{m}").__doc__ or
            "").strip(), f"nvfp4_jax.{sub}.{m} has no module docstring"
