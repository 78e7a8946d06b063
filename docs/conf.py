"""Sphinx configuration of the nvfp4-jax documentation.

Build: `sphinx-build -b html docs docs/_build` (`pip install -e ".[docs]"`).
Markdown pages are parsed by myst-parser and the notebooks rendered by myst-nb
(copied from `notebooks/` into `docs/notebooks/` at each build; rendered as
committed, without outputs: `tests/docs/test_notebooks.py` runs them, and
`NVFP4_DOCS_EXECUTE=1` executes them into the site); the API reference
(`api.md`) is autodoc over `nvfp4_jax.__all__` with Google-style docstrings
(napoleon).
Links to the JAX, Flax and optax references (intersphinx) need the network:
they are configured only when `NVFP4_DOCS_INTERSPHINX=1`, so an offline build,
as the test suite runs it with `-W`, fetches nothing.
"""

import os
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Autodoc imports the package; its reference numerics run on CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "nvfp4-jax"
author = "nvfp4-jax authors"
copyright = "2026, nvfp4-jax authors"  # pylint: disable=redefined-builtin
release = "0.1.0"

extensions = [
    "myst_nb",  # Registers myst-parser for the Markdown pages too.
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# The notebooks live in `notebooks/` (Colab opens them there); the site
# renders copies of them, refreshed at every build (`docs/notebooks/` is
# ignored by git). They are committed without outputs and run by the test
# suite, so the site shows them as committed unless asked to execute them.
_NOTEBOOKS = pathlib.Path(__file__).resolve().parent / "notebooks"
shutil.rmtree(_NOTEBOOKS, ignore_errors=True)
_NOTEBOOKS.mkdir()
for _nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
  shutil.copyfile(_nb, _NOTEBOOKS / _nb.name)
nb_execution_mode = ("cache" if os.environ.get("NVFP4_DOCS_EXECUTE") == "1"
                     else "off")
nb_execution_timeout = 1800

# Markdown: `#section` links resolve to headings down to level 3 (GitHub's
# slugs), `{eval-rst}` blocks hold the autodoc directives.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # `Attributes:` as fields: NamedTuple fields once.

intersphinx_mapping = {}
if os.environ.get("NVFP4_DOCS_INTERSPHINX") == "1":
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "flax": ("https://flax.readthedocs.io/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
      "numpy": ("https://numpy.org/doc/stable", None),
  }

# Pages under docs/ link to the repository's BENCHMARKS.md and RESULTS.md as
# files (so the links work where the Markdown is read as it is); on this
# site those are the pages that include them. The included files' own links
# to `results/` (plots) are to the repository's folder.
_SITE_LINKS = {
    "](../BENCHMARKS.md": "](benchmarks_reference.md",
    "](../RESULTS.md": "](results.md",
    "](BENCHMARKS.md": "](benchmarks_reference.md",
    "](RESULTS.md": "](results.md",
}


def _site_links(text: str) -> str:
  for old, new in _SITE_LINKS.items():
    text = text.replace(old, new)
  return text


def _on_source_read(app, docname, source):
  del app, docname
  source[0] = _site_links(source[0])


def _on_include_read(app, relative_path, parent_docname, content):
  del app, parent_docname
  if relative_path.parent == pathlib.Path(".."):  # ../RESULTS.md and the like
    content[0] = re.sub(r"(?<!!)(\[[^\]]*\])\(results/", r"\1(../results/",
                        content[0])  # Links; images are relative-images'.


# The docstrings write code as Markdown does, in single backticks (`x`,
# `Operand`s); reStructuredText reads those as interpreted text, and one
# followed by a letter as an error. Autodoc gets them as literals.
_CODE = re.compile(r"(?<![`\\w:])`([^`]+?)`(?![`_])(\w?)")


def _literal(match: re.Match) -> str:
  code, after = match.group(1), match.group(2)
  return f"``{code}``" + (f"\\ {after}" if after else "")


def _on_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  text = _CODE.sub(_literal, "\n".join(lines))
  lines[:] = text.split("\n")


def setup(app):
  app.connect("autodoc-process-docstring", _on_docstring)
  app.connect("source-read", _on_source_read)
  app.connect("include-read", _on_include_read)


html_theme = "alabaster"
html_title = "nvfp4-jax"
