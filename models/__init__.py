"""Example models built from `nvfp4_jax.NVFP4Dense`: an MLP and a GPT decoder."""

