"""`python -m train.export` (a run -> packed NVFP4 file -> samples) and
`python -m train.sensitivity` (table, suggested rules, SR bias, plot)."""

import pytest

from nvfp4_jax.tools import safetensors
from train import export as export_cli
from train import sensitivity as sensitivity_cli
from train.loop import Trainer
from tiny_training import MODEL, config, small_corpus


@pytest.mark.slow  # A training run, then export and generation (~25 s);
# test_export.py covers the library in the fast tier.
def test_export_a_run_and_generate(tmp_path, capsys):
  run = tmp_path / "run"
  # Any run of MODEL with a checkpoint will do; this is test_train_resume's
  # configuration, whose programs the session's compilation cache then holds
  # (10 steps of this model take well under a second once compiled).
  Trainer(config(steps=10, ckpt_every=3, eval_every=5, diagnostics=False),
          small_corpus(), MODEL).run(run, progress=False)
  out = tmp_path / "tiny.safetensors"
  assert export_cli.main([str(run), str(out), "--generate", "2",
                          "--mode", "weight_only"]) == 0
  text = capsys.readouterr().out
  assert "4 layers packed at 4.50 bits per weight" in text
  assert "equal the trained forward: True" in text
  assert "--- sample (weight_only) ---" in text
  tensors, meta = safetensors.load(out)
  assert "block_2.mlp.up.weight" in tensors and "head.kernel" in tensors
  assert "block_0.mlp.up.kernel" in tensors  # A BF16 block, unchanged.


def test_export_errors(tmp_path, capsys):
  assert export_cli.main([str(tmp_path), str(tmp_path / "x.st")]) == 2
  assert "holds no config.json" in capsys.readouterr().err


@pytest.mark.slow  # A training run, then the analysis (~25 s);
# test_sensitivity.py covers the library in the fast tier.
def test_sensitivity_cli(tmp_path, capsys):
  plot = tmp_path / "s.png"
  assert sensitivity_cli.main(["--batches", "1", "--batch-size", "2",
                               "--seq-len", "32", "--budget", "0.25",
                               "--sr-draws", "4", "--out", str(plot)]) == 0
  text = capsys.readouterr().out
  assert "fprop_err" in text and "suggested BF16 layers (6/24)" in text
  assert "PrecisionRules(rules=(" in text
  assert plot.read_bytes()[:4] == b"\x89PNG"
  sr = text[text.index("stochastic rounding bias over 4 draws"):]
  assert "bias_ratio" in sr.splitlines()[2]
  # Two SR GEMMs (Dgrad, Wgrad) per projection, 24 projections.
  assert sum(line.split()[1:2] in (["dgrad"], ["wgrad"])
             for line in sr.splitlines()[3:]) == 48


def test_sensitivity_cli_sr_draws_error(capsys):
  for bad in ("1", "-3"):
    with pytest.raises(SystemExit) as e:
      sensitivity_cli.main(["--sr-draws", bad])
    assert e.value.code == 2
    assert f"--sr-draws must be 0 (off) or >= 2, got {bad}" in (
        capsys.readouterr().err)
