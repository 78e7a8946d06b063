"""The documentation: the Sphinx site builds without a warning, the API
reference lists the public API, and the pages' Python examples parse (the ones
that run are run by the tests named in `RUN_BY`)."""

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The pages' examples that a test runs as written: a string that only that
# block holds, its page, and the test that runs it. Every other Python block
# is illustrative (it names a model, batches or checkpoints it does not
# build) and is only parsed.
RUN_BY = {
    "nv.NVFP4Dense(512)": (("README.md", "docs/layers.md"),
                           "tests/test_readme.py"),
    "inject_linen(": (("README.md", "docs/layers.md"),
                      "tests/test_third_party.py"),
    "inject_nnx(": (("docs/layers.md",), "tests/test_third_party.py"),
    "AxisType.Explicit": (("docs/sharding.md",),
                          "tests/test_mesh.py (mesh_checks)"),
    "nv.quantize_mx(x": (("docs/numerics.md",), "tests/test_readme.py"),
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


def test_pages_are_in_the_toctree():
  index = (DOCS / "index.md").read_text()
  listed = set(re.findall(r"^(\w+)$", index, re.M))
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert pages <= listed, pages - listed


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None
    or importlib.util.find_spec("myst_parser") is None,
    reason="sphinx and myst-parser are not installed (pip install -e "
    "'.[docs]')")
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
