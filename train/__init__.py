"""Training the example GPT with the NVFP4 recipe: data, loop, CLI, plots.

    python -m train                       # tiny GPT, bf16 vs nvfp4, on CPU
    python -m train --preset small --precision nvfp4

See `train.cli` for the flags, `train.loop.Trainer` for a run, `train.step` for
the jitted step and `train.report` for what a run reports.
"""
