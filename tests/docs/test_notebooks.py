"""notebooks/: committed without outputs, Colab-ready, and run top to bottom.

Execution uses nbclient with `NVFP4_NOTEBOOK_SMOKE=1`, which the notebooks read
to shrink their training runs to a few steps, and the repository on the
kernel's PYTHONPATH (the package need not be installed).
"""

import json
import os
import pathlib
import subprocess

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = ["01_quickstart", "02_numerics", "03_gpt_bf16_vs_nvfp4",
         "04_precision_rules"]
# The cheapest notebook runs in the fast tier, the others in the slow one.
FAST = "01_quickstart"


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def test_the_four_notebooks_exist():
  assert [p.stem for p in NOTEBOOKS] == NAMES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_opens_with_colab_install(path,
                                                               monkeypatch):
  # Every cell has its id in the file (nbformat 4.5; reading fills in
  # missing ones with a warning that will become an error).
  assert all("id" in c for c in json.loads(path.read_text())["cells"])
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in _code_cells(nb):
    assert cell.outputs == [] and cell.execution_count is None
  first = _code_cells(nb)[0].source
  assert 'if "google.colab" in sys.modules:' in first
  assert "pip" in first and "install" in first
  # Outside Colab the cell does nothing: no pip.
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
  exec(compile(first, path.name, "exec"), {})  # pylint: disable=exec-used
  assert calls == []
  monkeypatch.setitem(__import__("sys").modules, "google.colab", object())
  exec(compile(first, path.name, "exec"), {})  # pylint: disable=exec-used
  assert len(calls) == 1 and "install" in calls[0][0]


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=() if p.stem == FAST else pytest.mark.slow)
    for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
  monkeypatch.setenv("NVFP4_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  outputs = [o for c in _code_cells(nb) for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  # Every notebook shows at least one figure.
  assert any("image/png" in o.get("data", {}) for o in outputs)
