"""`nvfp4_jax.tools.check_device` with the example GPT's train step timed too.

    python -m benchmarks.check_device            # on the GPU (a few minutes)
    python -m benchmarks.check_device --small    # smoke run (CPU: interpreted)
    python -m benchmarks.check_device --target b200   # ahead of time, no GPU

The same flags and tables as `nvfp4-check-device`; its "GPT train step"
section is the GPT `small` step NVFP4 against BF16 (`--small`: `tiny`), each
step configuration in a fresh process (`benchmarks.bench_step`).
"""

from __future__ import annotations

import os
import sys

# `--target` compiles for a GPU that is not here (see the tool's module).
if __name__ == "__main__" and "--target" in " ".join(sys.argv):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import bench_step  # pylint: disable=g-import-not-at-top
from nvfp4_jax.tools import check_device  # pylint: disable=g-import-not-at-top
from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top


def gpt_step(small: bool) -> str:
  """The GPT train step's table: BF16 and NVFP4, `small` (or `tiny`)."""
  cfg = (dict(preset="tiny", batch=4, seq=64, steps=3) if small else
         dict(preset="small", batch=64, seq=512, steps=15))
  configs = [bench_step.StepConfig(precision=prec, **cfg)
             for prec in ("bf16", "nvfp4")]
  return timing.table(bench_step.run(configs, repeats=1 if small else 2),
                      bench_step.COLS)


def main(argv=None):
  check_device.main(argv, step=gpt_step)


if __name__ == "__main__":
  main()
