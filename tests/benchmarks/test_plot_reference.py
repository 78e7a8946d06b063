"""The benchmark reference's plots are drawn from its own tables."""

import pathlib

from benchmarks import plot_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = (ROOT / "BENCHMARKS.md").read_text()


def test_tables_parse_as_the_reference_prints_them():
  rows = plot_reference.scaling(TEXT)
  # The bold rows of the scaling table: the multi-GPU meshes of one run.
  assert [r[0] for r in rows] == ["data=4", "fsdp=2", "data=2,fsdp=2",
                                  "model=2"]
  assert rows[0][1:] == (0.95, 0.939, 0.895)
  steps = plot_reference.breakdown(TEXT)
  assert steps[0] == ("BF16 `data=1`", 39.56, 0.0, 0.0, 38.34, 0.79)
  assert len(steps) == 14
  # Each step is at least its compute plus its exposed NCCL.
  for name, step, nccl, exposed, compute, idle in steps:
    assert 0 <= exposed <= nccl and compute + exposed <= step + 0.01, name


def test_plots_are_written_and_linked(tmp_path):
  paths = plot_reference.plot(TEXT, tmp_path)
  assert [p.name for p in paths] == ["scaling.png", "step_breakdown.png"]
  for p in paths:
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The committed figure is linked from the reference.
    assert f"(results/{p.name})" in TEXT
    assert (ROOT / "results" / p.name).is_file()
